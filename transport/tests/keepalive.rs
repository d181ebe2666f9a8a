//! Keep-alive pings end to end: a peer that hangs (it finished its handshake, then answers
//! nothing) is closed within the interval plus the timeout, naming the setting, on a plain
//! listener and on a gRPC server; a live channel that pings stays up through idle time and
//! its next call goes through on the same connection. The clock-exact behaviour is tested
//! in `proto_sim.rs`; here real time only bounds a hang.

mod grpc_common;
mod hostile_util;

use std::time::{Duration, Instant};

use grpc_common::BenchImpl;
use grpc_common::transports::ibex_config;
use hostile_util::{Outcome, Peer, fixed_threshold, uri};
use ibex_proto::bench::v1::Payload;
use ibex_proto::bench::v1::bench_client::BenchClient;
use ibex_transport::grpc::{Endpoint, Server};
use ibex_transport::{Config, listen};

const INTERVAL: Duration = Duration::from_millis(200);
const TIMEOUT: Duration = Duration::from_millis(300);
/// A hang guard, not a performance assertion.
const GUARD: Duration = Duration::from_secs(10);

async fn hung_peer_is_closed(at: &str) -> Duration {
    let mut p = Peer::connect_uri(at).await;
    p.handshake().await;
    let t = Instant::now();
    // Reads what comes, answers nothing.
    let o = tokio::time::timeout(GUARD, p.outcome("a hung peer"))
        .await
        .expect("hang guard");
    match o {
        Outcome::Closed { reason, .. } => assert!(
            reason.contains("keep-alive") && reason.contains("IBEX_KEEPALIVE_TIMEOUT_MS"),
            "closed with {reason:?}"
        ),
        Outcome::Ended(e) => panic!("the link ended without a Close naming keep-alive: {e}"),
    }
    t.elapsed()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listener_closes_a_hung_peer_after_interval_plus_timeout() {
    for provider in ["tcp", "shm"] {
        let cfg = Config {
            keepalive: Some(INTERVAL),
            keepalive_timeout: TIMEOUT,
            ..fixed_threshold(16 << 10)
        };
        let l = listen(&uri(provider, "keepalive"), cfg).await.unwrap();
        let at = l.local_uri();
        let server = tokio::spawn(async move {
            let c = l.accept().await.unwrap();
            let e = c.recv().await.expect_err("the hung peer sent nothing");
            e.to_string()
        });
        let took = hung_peer_is_closed(&at).await;
        let why = server.await.unwrap();
        assert!(
            why.contains("keep-alive"),
            "{provider}: the server's error: {why}"
        );
        assert!(
            took >= INTERVAL + TIMEOUT - Duration::from_millis(50),
            "{provider}: closed after {took:?}, before interval + timeout"
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grpc_server_with_keepalive_closes_hung_clients_and_keeps_live_ones() {
    let listener = listen(&uri("tcp", "grpc-keepalive"), ibex_config())
        .await
        .unwrap();
    let at = listener.local_uri();
    let (svc, _events) = BenchImpl::new();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(
        Server::builder()
            .http2_keepalive_interval(Some(INTERVAL))
            .http2_keepalive_timeout(Some(TIMEOUT))
            .add_service(svc.server(None, None))
            .serve_with_listener(listener, async {
                let _ = stop_rx.await;
            }),
    );

    // A client that pings too, idle for several intervals: still up, same connection.
    let ch = Endpoint::new(at.clone())
        .config(ibex_config())
        .http2_keep_alive_interval(Duration::from_millis(100))
        .keep_alive_timeout(Duration::from_secs(2))
        .connect()
        .await
        .unwrap();
    let mut client = BenchClient::new(ch.clone());
    let echo = Payload {
        buffers: vec![vec![7u8; 100].into()],
    };
    assert_eq!(client.echo(echo.clone()).await.unwrap().into_inner(), echo);
    let conn = ch.connection().expect("an Ibex connection");
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert!(!conn.is_closed(), "a live, pinging client was closed");
    assert_eq!(client.echo(echo.clone()).await.unwrap().into_inner(), echo);
    assert!(!conn.is_closed());

    // A client that hangs is closed by the server's pings.
    let took = hung_peer_is_closed(&at).await;
    assert!(
        took >= INTERVAL + TIMEOUT - Duration::from_millis(50),
        "{took:?}"
    );

    let _ = stop_tx.send(());
    let _ = tokio::time::timeout(GUARD, server).await;
}
