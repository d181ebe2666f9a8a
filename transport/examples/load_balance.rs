//! Load balancing as with tonic's channel, over a mix of Ibex providers: three Greeter
//! servers (two on tcp, one on shm) and one client channel that balances its calls over
//! them with `Channel::balance_list`, then adds and removes servers at run time with
//! `Channel::balance_channel`. Each answer names the server that gave it.
//!
//! ```text
//! cargo run -p ibex-transport --example load_balance
//! ```

use std::collections::BTreeMap;
use std::time::Duration;

use ibex_proto::helloworld::greeter_client::GreeterClient;
use ibex_proto::helloworld::greeter_server::{Greeter, GreeterServer};
use ibex_proto::helloworld::{HelloReply, HelloRequest};
use ibex_transport::grpc::channel::Change;
use ibex_transport::grpc::{Channel, Endpoint, Server};
use tonic::{Request, Response, Status};

struct Named(String);

#[tonic::async_trait]
impl Greeter for Named {
    async fn say_hello(
        &self,
        request: Request<HelloRequest>,
    ) -> Result<Response<HelloReply>, Status> {
        Ok(Response::new(HelloReply {
            message: format!("Hello {} from {}", request.into_inner().name, self.0),
        }))
    }
}

/// Starts a Greeter on `uri` (port 0: any free port) and returns its address.
async fn start(uri: &str) -> Result<String, Box<dyn std::error::Error>> {
    let listener = ibex_transport::listen(uri, ibex_transport::Config::default()).await?;
    let addr = listener.local_uri();
    let svc = GreeterServer::new(Named(addr.clone()));
    tokio::spawn(
        Server::builder()
            .add_service(svc)
            .serve_with_listener(listener, std::future::pending()),
    );
    Ok(addr)
}

/// Makes `n` calls and counts the answers by server.
async fn calls(
    client: &mut GreeterClient<Channel>,
    n: usize,
) -> Result<BTreeMap<String, usize>, Box<dyn std::error::Error>> {
    let mut by_server = BTreeMap::new();
    for _ in 0..n {
        let reply = client
            .say_hello(HelloRequest {
                name: "Ibex".into(),
            })
            .await?;
        let server = reply
            .into_inner()
            .message
            .rsplit(' ')
            .next()
            .unwrap_or("?")
            .to_string();
        *by_server.entry(server).or_insert(0) += 1;
    }
    Ok(by_server)
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let shm = format!(
        "shm://{}/ibex-lb-{}.sock",
        std::env::temp_dir().display(),
        std::process::id()
    );
    let servers = [
        start("tcp://127.0.0.1:0").await?,
        start("tcp://127.0.0.1:0").await?,
        start(&shm).await?,
    ];

    // A fixed list, as tonic's load_balance example.
    let endpoints = servers
        .iter()
        .map(|a| Endpoint::from_shared(a.clone()))
        .collect::<Result<Vec<_>, _>>()?;
    let mut client = GreeterClient::new(Channel::balance_list(endpoints.into_iter()));
    println!(
        "balance_list, 30 calls: {:?}",
        calls(&mut client, 30).await?
    );

    // Endpoints that come and go, as tonic's dynamic_load_balance example.
    let (channel, changes) = Channel::balance_channel::<usize>(8);
    let mut client = GreeterClient::new(channel);
    changes
        .send(Change::Insert(
            0,
            Endpoint::from_shared(servers[0].clone())?,
        ))
        .await?;
    println!(
        "one endpoint, 10 calls: {:?}",
        calls(&mut client, 10).await?
    );
    changes
        .send(Change::Insert(
            2,
            Endpoint::from_shared(servers[2].clone())?,
        ))
        .await?;
    changes.send(Change::Remove(0)).await?;
    // Changes are applied by the channel's task; give it a moment.
    tokio::time::sleep(Duration::from_millis(50)).await;
    println!(
        "after swapping it for the shm one, 10 calls: {:?}",
        calls(&mut client, 10).await?
    );
    Ok(())
}
