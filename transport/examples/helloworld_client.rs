//! The classic tonic Greeter client, over stock tonic (HTTP/2 over TCP) or over Ibex.
//! The generated client is plain tonic; only the channel line depends on the transport.
//!
//! ```text
//! cargo run --example helloworld_client -- --transport tonic [http://127.0.0.1:50051]
//! cargo run --example helloworld_client -- --transport ibex  [shm:///tmp/ibex-helloworld.sock | tcp://127.0.0.1:50052]
//! ```

use ibex_proto::helloworld::HelloRequest;
use ibex_proto::helloworld::greeter_client::GreeterClient;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (transport, addr) = args()?;
    let request = || {
        tonic::Request::new(HelloRequest {
            name: "Ibex".into(),
        })
    };
    let reply = match transport.as_str() {
        "tonic" => {
            let mut client = GreeterClient::new(
                tonic::transport::Channel::from_shared(addr)?
                    .connect()
                    .await?,
            );
            client.say_hello(request()).await?
        }
        _ => {
            let mut client =
                GreeterClient::new(ibex_transport::grpc::Channel::connect(&addr).await?);
            client.say_hello(request()).await?
        }
    };
    println!("{}", reply.into_inner().message);
    Ok(())
}

/// `--transport tonic|ibex` and an optional address.
fn args() -> Result<(String, String), String> {
    let mut transport = "tonic".to_string();
    let mut addr = None;
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        match a.as_str() {
            "--transport" => transport = it.next().ok_or("--transport needs tonic or ibex")?,
            _ if addr.is_none() => addr = Some(a),
            _ => {
                return Err(format!(
                    "unexpected argument {a:?}; usage: [--transport tonic|ibex] [ADDR]"
                ));
            }
        }
    }
    let addr = match transport.as_str() {
        "tonic" => addr.unwrap_or_else(|| "http://127.0.0.1:50051".into()),
        "ibex" => addr.unwrap_or_else(|| "shm:///tmp/ibex-helloworld.sock".into()),
        t => return Err(format!("unknown transport {t:?}: use tonic or ibex")),
    };
    Ok((transport, addr))
}
