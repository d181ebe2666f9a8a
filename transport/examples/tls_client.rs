//! The Greeter client over TLS with its own certificate, written with tonic's TLS API; see
//! `tls_server.rs`.
//!
//! ```text
//! cargo run --example tls_client [tcp://127.0.0.1:50053 | https://127.0.0.1:50054]
//! ```

use ibex_proto::helloworld::HelloRequest;
use ibex_proto::helloworld::greeter_client::GreeterClient;
use ibex_transport::grpc::{Certificate, ClientTlsConfig, Endpoint, Identity};

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let addr = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "tcp://127.0.0.1:50053".into());
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/tls");
    let ca = std::fs::read(format!("{dir}/ca.pem"))?;
    let cert = std::fs::read(format!("{dir}/client.pem"))?;
    let key = std::fs::read(format!("{dir}/client.key"))?;
    let tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(ca))
        .identity(Identity::from_pem(cert, key))
        // The certificate is for localhost and 127.0.0.1; name it for other addresses.
        .domain_name("localhost");
    let channel = Endpoint::new(addr)?.tls_config(tls)?.connect().await?;
    let mut client = GreeterClient::new(channel);
    let reply = client
        .say_hello(HelloRequest {
            name: "Ibex".into(),
        })
        .await?;
    println!("{}", reply.into_inner().message);
    Ok(())
}
