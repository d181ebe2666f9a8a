//! gRPC quick comparison: `cargo bench -p ibex-transport --bench grpc` (`-- --quick`).
//!
//! The same generated `Bench` client and server, server in a separate process, over stock
//! tonic (HTTP/2 over TCP loopback, default settings), Ibex shm and Ibex tcp: 64 B unary
//! Echo latency and 16 MiB Sink bandwidth, side by side in one run. Full benchmarking
//! (TF-gRPC-Bench workloads, sweeps, PS throughput) belongs to `ibex-bench`.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Instant;

use bytes::Bytes;
use ibex_proto::bench::v1::bench_client::BenchClient;
use ibex_proto::bench::v1::bench_server::{Bench, BenchServer};
use ibex_proto::bench::v1::{Ack, Payload, StreamRequest};
use tokio_stream::StreamExt;
use tonic::{Request, Response, Status, Streaming};

const SINK: usize = 16 << 20;

struct Svc;

#[tonic::async_trait]
impl Bench for Svc {
    async fn echo(&self, req: Request<Payload>) -> Result<Response<Payload>, Status> {
        Ok(Response::new(req.into_inner()))
    }
    async fn sink(&self, req: Request<Payload>) -> Result<Response<Ack>, Status> {
        let p = req.into_inner();
        Ok(Response::new(Ack { bytes: p.buffers.iter().map(|b| b.len() as u64).sum(), buffers: p.buffers.len() as u32 }))
    }
    type StreamStream = tokio_stream::Empty<Result<Payload, Status>>;
    async fn stream(&self, _: Request<StreamRequest>) -> Result<Response<Self::StreamStream>, Status> {
        Err(Status::unimplemented("not benchmarked here"))
    }
    type ChatStream = tokio_stream::Empty<Result<Payload, Status>>;
    async fn chat(&self, _: Request<Streaming<Payload>>) -> Result<Response<Self::ChatStream>, Status> {
        Err(Status::unimplemented("not benchmarked here"))
    }
    async fn upload(&self, _: Request<Streaming<Payload>>) -> Result<Response<Ack>, Status> {
        Err(Status::unimplemented("not benchmarked here"))
    }
}

fn server(kind: &str) {
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().expect("runtime");
    rt.block_on(async move {
        let svc = BenchServer::new(Svc).max_decoding_message_size(64 << 20).max_encoding_message_size(64 << 20);
        match kind {
            "tonic" => {
                let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.expect("bind");
                println!("http://{}", l.local_addr().expect("addr"));
                // serve_with_incoming leaves Nagle on: small calls would wait on delayed ACKs.
                let incoming = tokio_stream::wrappers::TcpListenerStream::new(l).map(|s| {
                    s.inspect(|s| {
                        let _ = s.set_nodelay(true);
                    })
                });
                tonic::transport::Server::builder().add_service(svc).serve_with_incoming(incoming).await.expect("serve");
            }
            other => {
                let uri = if other == "shm" {
                    format!("shm://{}", std::env::temp_dir().join(format!("ibex-grpc-bench-{}.sock", std::process::id())).display())
                } else {
                    "tcp://127.0.0.1:0".to_string()
                };
                let l = ibex_transport::listen(&uri, ibex_transport::Config::from_env().expect("config")).await.expect("listen");
                println!("{}", l.local_uri());
                ibex_transport::grpc::Server::builder()
                    .add_service(svc)
                    .serve_with_listener(l, std::future::pending())
                    .await
                    .expect("serve");
            }
        }
    });
}

struct Row {
    name: &'static str,
    p50_us: f64,
    p99_us: f64,
    sink_gbps: f64,
}

async fn measure<T>(mut c: BenchClient<T>, iters: usize, sink_reps: usize) -> (f64, f64, f64)
where
    T: tonic::client::GrpcService<tonic::body::Body>,
    T::Error: Into<tonic::codegen::StdError>,
    T::ResponseBody: http_body::Body<Data = Bytes> + Send + 'static,
    <T::ResponseBody as http_body::Body>::Error: Into<tonic::codegen::StdError> + Send,
{
    let small = Payload { buffers: vec![Bytes::from(vec![1u8; 64])] };
    let mut lat = Vec::with_capacity(iters);
    for i in 0..iters + iters / 10 {
        let t = Instant::now();
        c.echo(small.clone()).await.expect("echo");
        if i >= iters / 10 {
            lat.push(t.elapsed().as_secs_f64() * 1e6);
        }
    }
    lat.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
    let big = Payload { buffers: vec![Bytes::from(vec![2u8; SINK])] };
    c.sink(big.clone()).await.expect("warm-up sink");
    let mut bws = Vec::new();
    for _ in 0..sink_reps {
        let t = Instant::now();
        let n = 8;
        for _ in 0..n {
            c.sink(big.clone()).await.expect("sink");
        }
        bws.push((n * SINK) as f64 / t.elapsed().as_secs_f64() / 1e9);
    }
    bws.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
    (lat[lat.len() / 2], lat[lat.len() * 99 / 100], bws[bws.len() / 2])
}

fn spawn(kind: &str) -> (Child, String) {
    let mut child = Command::new(std::env::current_exe().expect("exe"))
        .args(["--ibex-grpc-server", kind])
        .stdout(Stdio::piped())
        .spawn()
        .expect("spawn server");
    let mut line = String::new();
    BufReader::new(child.stdout.take().expect("stdout")).read_line(&mut line).expect("server address");
    (child, line.trim().to_string())
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if let Some(i) = args.iter().position(|a| a == "--ibex-grpc-server") {
        server(&args[i + 1]);
        return;
    }
    let quick = args.iter().any(|a| a == "--quick");
    let (iters, reps) = if quick { (2000, 3) } else { (20_000, 5) };
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().expect("runtime");
    let mut rows = Vec::new();
    for (name, kind) in [("stock tonic/TCP", "tonic"), ("Ibex shm", "shm"), ("Ibex tcp", "tcp")] {
        let (mut child, addr) = spawn(kind);
        let (p50, p99, bw) = rt.block_on(async {
            if kind == "tonic" {
                let ch = tonic::transport::Endpoint::from_shared(addr.clone()).expect("uri").connect().await.expect("connect");
                let c = BenchClient::new(ch).max_decoding_message_size(64 << 20).max_encoding_message_size(64 << 20);
                measure(c, iters, reps).await
            } else {
                let ch = ibex_transport::grpc::Channel::connect(&addr).await.expect("connect");
                let c = BenchClient::new(ch).max_decoding_message_size(64 << 20).max_encoding_message_size(64 << 20);
                measure(c, iters, reps).await
            }
        });
        let _ = child.kill();
        let _ = child.wait();
        rows.push(Row { name, p50_us: p50, p99_us: p99, sink_gbps: bw });
    }
    println!("\n{:<18} {:>14} {:>14} {:>16}", "transport", "echo p50 µs", "echo p99 µs", "16 MiB sink GB/s");
    for r in &rows {
        println!("{:<18} {:>14.1} {:>14.1} {:>16.2}", r.name, r.p50_us, r.p99_us, r.sink_gbps);
    }
    let base = &rows[0];
    println!("\nratios against stock tonic (same run):");
    for r in &rows[1..] {
        println!(
            "  {:<10} echo p50 {:.1}x lower, sink {:.2}x higher",
            r.name,
            base.p50_us / r.p50_us,
            r.sink_gbps / base.sink_gbps
        );
    }
}
