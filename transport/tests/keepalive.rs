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

/// How long the hung peer waited for its close, counted from before it connected: the
/// server's keep-alive clock starts at or after its accept, so a late start here would let
/// a loaded client see less than interval + timeout.
async fn hung_peer_is_closed(at: &str) -> Duration {
    let t = Instant::now();
    let mut p = Peer::connect_uri(at).await;
    p.handshake().await;
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

/// How long the live client's server (and the client itself) waits for an answer to a
/// ping: a loaded machine can stall a runtime for longer than [`TIMEOUT`], which would
/// close a live client for no fault of its own.
const LIVE_TIMEOUT: Duration = Duration::from_secs(2);

/// A gRPC server on `listener`, pinging with `interval` and `timeout`; it stops when the
/// returned sender is sent to or dropped.
fn grpc_server(
    listener: ibex_transport::Listener,
    interval: Duration,
    timeout: Duration,
) -> (
    tokio::task::JoinHandle<impl Sized>,
    tokio::sync::oneshot::Sender<()>,
) {
    let (svc, _events) = BenchImpl::new();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(
        Server::builder()
            .http2_keepalive_interval(Some(interval))
            .http2_keepalive_timeout(Some(timeout))
            .add_service(svc.server(None, None))
            .serve_with_listener(listener, async {
                let _ = stop_rx.await;
            }),
    );
    (server, stop_tx)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grpc_server_with_keepalive_closes_hung_clients_and_keeps_live_ones() {
    // The hung client runs against the short timeout, the live one against a longer one;
    // both servers ping at the same interval.
    let hung_listener = listen(&uri("tcp", "grpc-keepalive-hung"), ibex_config())
        .await
        .unwrap();
    let hung_at = hung_listener.local_uri();
    let (hung_server, hung_stop) = grpc_server(hung_listener, INTERVAL, TIMEOUT);
    let live_listener = listen(&uri("tcp", "grpc-keepalive-live"), ibex_config())
        .await
        .unwrap();
    let live_at = live_listener.local_uri();
    let (live_server, live_stop) = grpc_server(live_listener, INTERVAL, LIVE_TIMEOUT);

    // A client that pings too, idle for several intervals: still up, same connection.
    let ch = Endpoint::new(live_at)
        .unwrap()
        .config(ibex_config())
        .http2_keep_alive_interval(Duration::from_millis(100))
        .keep_alive_timeout(LIVE_TIMEOUT)
        .connect()
        .await
        .unwrap();
    let mut client = BenchClient::new(ch.clone());
    let echo = Payload {
        buffers: vec![vec![7u8; 100].into()],
    };
    assert_eq!(client.echo(echo.clone()).await.unwrap().into_inner(), echo);
    let conn = ch.connection().expect("an Ibex connection");
    // Idle past the interval plus the timeout, so a server that closed a client despite its
    // answers would have done it by now. The hung client's check shares the wait.
    let idle = INTERVAL + LIVE_TIMEOUT + Duration::from_millis(300);
    let ((), took) = tokio::join!(tokio::time::sleep(idle), hung_peer_is_closed(&hung_at));
    assert!(!conn.is_closed(), "a live, pinging client was closed");
    assert_eq!(client.echo(echo.clone()).await.unwrap().into_inner(), echo);
    assert!(!conn.is_closed());

    // The client that hung was closed by the server's pings.
    assert!(
        took >= INTERVAL + TIMEOUT - Duration::from_millis(50),
        "{took:?}"
    );

    for (server, stop) in [(hung_server, hung_stop), (live_server, live_stop)] {
        let _ = stop.send(());
        let _ = tokio::time::timeout(GUARD, server).await;
    }
}
