//! The classic tonic Greeter, served over stock tonic (HTTP/2 over TCP) or over Ibex.
//! The service is plain tonic; only the server line depends on the transport.
//!
//! ```text
//! cargo run --example helloworld_server -- --transport tonic [127.0.0.1:50051]
//! cargo run --example helloworld_server -- --transport ibex  [shm:///tmp/ibex-helloworld.sock | tcp://127.0.0.1:50052]
//! ```

use ibex_proto::helloworld::greeter_server::{Greeter, GreeterServer};
use ibex_proto::helloworld::{HelloReply, HelloRequest};
use tonic::{Request, Response, Status};

#[derive(Default)]
struct MyGreeter;

#[tonic::async_trait]
impl Greeter for MyGreeter {
    async fn say_hello(
        &self,
        request: Request<HelloRequest>,
    ) -> Result<Response<HelloReply>, Status> {
        let reply = HelloReply {
            message: format!("Hello {}!", request.into_inner().name),
        };
        Ok(Response::new(reply))
    }
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let (transport, addr) = args()?;
    let svc = GreeterServer::new(MyGreeter);
    println!("Greeter listening on {addr} ({transport})");
    match transport.as_str() {
        "tonic" => {
            tonic::transport::Server::builder()
                .add_service(svc)
                .serve(addr.parse()?)
                .await?
        }
        _ => {
            ibex_transport::grpc::Server::builder()
                .add_service(svc)
                .serve_uri(&addr)
                .await?
        }
    }
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
        "tonic" => addr.unwrap_or_else(|| "127.0.0.1:50051".into()),
        "ibex" => addr.unwrap_or_else(|| "shm:///tmp/ibex-helloworld.sock".into()),
        t => return Err(format!("unknown transport {t:?}: use tonic or ibex")),
    };
    Ok((transport, addr))
}
