//! The Greeter over TLS with mutual authentication, written with tonic's TLS API: the
//! same builder serves Ibex tcp (`tcp://`) and stock HTTP/2 (`https://`), and the handler
//! reads the client's certificate with `request.peer_certs()` on both.
//!
//! ```text
//! cargo run --example tls_server [tcp://127.0.0.1:50053 | https://127.0.0.1:50054]
//! cargo run --example tls_client [tcp://127.0.0.1:50053 | https://127.0.0.1:50054]
//! ```
//!
//! The certificates are the test ones in `tests/data/tls`: make your own for real use.

use ibex_proto::helloworld::greeter_server::{Greeter, GreeterServer};
use ibex_proto::helloworld::{HelloReply, HelloRequest};
use ibex_transport::grpc::{Certificate, Identity, Server, ServerTlsConfig};
use tonic::{Request, Response, Status};

#[derive(Default)]
struct MyGreeter;

#[tonic::async_trait]
impl Greeter for MyGreeter {
    async fn say_hello(
        &self,
        request: Request<HelloRequest>,
    ) -> Result<Response<HelloReply>, Status> {
        let certs = request.peer_certs().map_or(0, |c| c.len());
        let reply = HelloReply {
            message: format!(
                "Hello {}! (you showed {certs} certificate(s))",
                request.into_inner().name
            ),
        };
        Ok(Response::new(reply))
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let addr = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "tcp://127.0.0.1:50053".into());
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/data/tls");
    let cert = std::fs::read(format!("{dir}/server.pem"))?;
    let key = std::fs::read(format!("{dir}/server.key"))?;
    let client_ca = std::fs::read(format!("{dir}/ca.pem"))?;
    let tls = ServerTlsConfig::new()
        .identity(Identity::from_pem(cert, key))
        .client_ca_root(Certificate::from_pem(client_ca));
    println!("Greeter listening on {addr} (TLS, client certificates required)");
    Server::builder()
        .tls_config(tls)?
        .add_service(GreeterServer::new(MyGreeter))
        .serve_any(&addr, async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await?;
    Ok(())
}
