//! What a worker sees when a PS fails: a PS that accepts and never answers, and one whose
//! host vanishes mid-job. Each must end in an error that names the PS, the call and the
//! setting, within that setting's bound, never a hang.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use ibex_worker::{ClusterSpec, Timeouts, TransportKind, Worker, WorkerError};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// A TCP relay in front of a PS that can go silent: once `frozen`, whatever either side
/// sends is read and dropped, and both connections stay open, as with a host that lost
/// power or a partition that eats packets.
struct Relay {
    port: u16,
    frozen: Arc<AtomicBool>,
}

impl Relay {
    async fn start(upstream: Option<String>) -> Relay {
        let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = l.local_addr().unwrap().port();
        let frozen = Arc::new(AtomicBool::new(upstream.is_none()));
        let f = frozen.clone();
        tokio::spawn(async move {
            while let Ok((down, _)) = l.accept().await {
                let f = f.clone();
                let upstream = upstream.clone();
                tokio::spawn(async move {
                    let (dr, dw) = down.into_split();
                    let Some(up) = upstream else {
                        // Nothing behind it: read, never answer, keep the connection open.
                        let _open = dw;
                        pipe(dr, None::<tokio::net::tcp::OwnedWriteHalf>, f).await;
                        return;
                    };
                    let Ok(up) = TcpStream::connect(&up).await else {
                        return;
                    };
                    let (ur, uw) = up.into_split();
                    tokio::spawn(pipe(dr, Some(uw), f.clone()));
                    pipe(ur, Some(dw), f).await;
                });
            }
        });
        Relay { port, frozen }
    }

    fn addr(&self) -> String {
        format!("127.0.0.1:{}", self.port)
    }

    fn freeze(&self) {
        self.frozen.store(true, Ordering::SeqCst);
    }
}

/// Copies `r` to `w` until either closes; once `frozen`, drops what it reads instead.
async fn pipe<W: tokio::io::AsyncWrite + Unpin>(
    mut r: tokio::net::tcp::OwnedReadHalf,
    mut w: Option<W>,
    frozen: Arc<AtomicBool>,
) {
    let mut buf = vec![0u8; 64 << 10];
    loop {
        let n = match r.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if frozen.load(Ordering::SeqCst) {
            continue;
        }
        if let Some(w) = &mut w
            && w.write_all(&buf[..n]).await.is_err()
        {
            return;
        }
    }
}

/// The transport settings, from the environment as the binaries read them.
fn transport() -> ibex_transport::Config {
    ibex_worker::transport_config().expect("IBEX_* environment variables")
}

fn spec(ps: String, t: Timeouts) -> ClusterSpec {
    ClusterSpec::new(vec![ps], vec!["127.0.0.1:1".into()], TransportKind::Tcp)
        .unwrap()
        .with_timeouts(t)
        .unwrap()
}

fn short(connect: u64, call: u64, keepalive: Option<u64>) -> Timeouts {
    Timeouts {
        sync: Duration::from_secs(20),
        connect: Duration::from_millis(connect),
        call: Duration::from_millis(call),
        keepalive: keepalive.map(Duration::from_millis),
        keepalive_timeout: Duration::from_millis(keepalive.unwrap_or(1000)),
    }
}

/// A server that accepts and never answers: connecting fails at the connect deadline, with
/// an error that names the server, the step (connect) and the setting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connecting_to_a_silent_server_ends_at_the_connect_deadline() {
    let silent = Relay::start(None).await;
    let t0 = Instant::now();
    let e = Worker::connect(
        &spec(silent.addr(), short(1500, 1000, None)),
        0,
        &transport(),
    )
    .await
    .unwrap_err();
    let took = t0.elapsed();
    let msg = e.to_string();
    eprintln!("connect: {msg} after {took:?}");
    assert!(matches!(e, WorkerError::Deadline { .. }), "{msg}");
    assert!(
        msg.contains(&silent.addr())
            && msg.contains("connect")
            && msg.contains("connect_timeout_secs"),
        "{msg}"
    );
    assert!(
        took >= Duration::from_millis(1400),
        "gave up early: {took:?}"
    );
    assert!(took < Duration::from_secs(5), "took {took:?}");
}

/// A PS that stops answering after the connection is up: every call ends at the call
/// deadline with an error naming the PS's address, the call and the setting.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn calls_to_a_ps_that_stopped_answering_end_at_the_call_deadline() {
    let (ps_spec, _stop) = common::start_sync_ps(TransportKind::Tcp, 1, 1);
    let relay = Relay::start(Some(ps_spec.ps[0].clone())).await;
    // Keep-alive off: the deadline alone must end the call.
    let w = Worker::connect(
        &spec(relay.addr(), short(20_000, 1500, None)),
        0,
        &transport(),
    )
    .await
    .unwrap();
    w.stats().await.unwrap();
    relay.freeze();
    for call in ["Stats", "Save"] {
        let t0 = Instant::now();
        let e = match call {
            "Stats" => w.stats().await.map(|_| ()).unwrap_err(),
            _ => w.save().await.map(|_| ()).unwrap_err(),
        };
        let took = t0.elapsed();
        let msg = e.to_string();
        assert!(matches!(e, WorkerError::Deadline { .. }), "{msg}");
        assert_eq!(e.code(), Some(tonic::Code::DeadlineExceeded));
        assert!(
            msg.contains(&relay.addr()) && msg.contains(call) && msg.contains("call_timeout_secs"),
            "{msg}"
        );
        eprintln!("{call}: {e:?} after {took:?}");
        assert!(took < Duration::from_secs(4), "{call} took {took:?}");
    }
}

/// A PS whose host vanishes (nothing answers, nothing closes) while a call waits on it:
/// the keep-alive, on by default, notices within its interval plus its timeout (3 s + 5 s)
/// and fails the call `Unavailable`, long before the call's own deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_vanished_ps_host_is_seen_by_the_keepalive_within_seconds() {
    let (ps_spec, _stop) = common::start_sync_ps(TransportKind::Tcp, 1, 1);
    let relay = Relay::start(Some(ps_spec.ps[0].clone())).await;
    let t = Timeouts {
        call: Duration::from_secs(60),
        ..Timeouts::default()
    };
    assert_eq!(t.keepalive, Some(Duration::from_secs(3)));
    let w = Worker::connect(&spec(relay.addr(), t), 0, &transport())
        .await
        .unwrap();
    w.stats().await.unwrap();
    relay.freeze();
    let t0 = Instant::now();
    let e = w.stats().await.map(|_| ()).unwrap_err();
    let took = t0.elapsed();
    eprintln!("vanished host: {e} after {took:?}");
    assert!(matches!(e, WorkerError::Unavailable { .. }), "{e}");
    assert!(took < Duration::from_secs(10), "took {took:?}");
}

/// The PS's side of the same: a worker whose host vanishes is noticed by the PS's own
/// keep-alive (on by default; 1 s + 1 s here), which closes its connection.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_ps_drops_a_vanished_worker_within_its_keepalive() {
    let ps = format!("127.0.0.1:{}", common::free_port());
    let metrics = common::free_port();
    let mut cfg = ibex_ps::PsConfig::new(format!("tcp://{ps}"));
    cfg.metrics = Some(format!("127.0.0.1:{metrics}"));
    cfg.keepalive = Some(Duration::from_secs(1));
    cfg.keepalive_timeout = Duration::from_secs(1);
    let (_stop, rx) = tokio::sync::oneshot::channel::<()>();
    tokio::spawn(ibex_ps::run(cfg, async move {
        let _ = rx.await;
    }));
    let relay = Relay::start(Some(ps)).await;
    // No pings from the worker: the PS alone must notice.
    let w = Worker::connect(
        &spec(relay.addr(), short(20_000, 60_000, None)),
        0,
        &transport(),
    )
    .await
    .unwrap();
    w.stats().await.unwrap();
    assert_eq!(open_connections(metrics).await, 1);
    relay.freeze();
    let t0 = Instant::now();
    while open_connections(metrics).await != 0 {
        assert!(
            t0.elapsed() < Duration::from_secs(6),
            "the PS still holds the vanished worker's connection"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    eprintln!(
        "the PS dropped the vanished worker after {:?}",
        t0.elapsed()
    );
    drop(w);
}

/// `ibex_transport_connections` from the PS's metrics endpoint.
async fn open_connections(port: u16) -> u64 {
    let mut s = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    s.write_all(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
        .await
        .unwrap();
    let mut body = String::new();
    let _ = tokio::time::timeout(Duration::from_secs(5), s.read_to_string(&mut body)).await;
    body.lines()
        .find(|l| l.starts_with("ibex_transport_connections{"))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no ibex_transport_connections in:\n{body}"))
}
