//! tonic's channel surface over Ibex: endpoints made as tonic makes them, generated
//! `connect`, a server on a `SocketAddr`, load balancing over a mix of providers with
//! endpoints that come, go and fail, and a reconnect whose first call after the server is
//! back succeeds.

mod grpc_common;

use std::future::Future;
use std::time::Duration;

use grpc_common::service::Event;
use grpc_common::{BenchImpl, Events};
use ibex_proto::bench::v1::Payload;
use ibex_proto::bench::v1::bench_ibex::BenchClient;
use ibex_transport::grpc::channel::Change;
use ibex_transport::grpc::{Channel, Endpoint, Server};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

async fn within<F: Future>(f: F) -> F::Output {
    tokio::time::timeout(Duration::from_secs(60), f)
        .await
        .expect("test hung")
}

/// A running server and what its handlers report.
struct Srv {
    uri: String,
    events: Events,
    stop: oneshot::Sender<()>,
    task: JoinHandle<ibex_transport::Result<()>>,
}

impl Srv {
    async fn start(uri: &str) -> Srv {
        let listener = ibex_transport::listen(uri, ibex_transport::Config::default())
            .await
            .unwrap();
        let uri = listener.local_uri();
        let (svc, events) = BenchImpl::new();
        let (stop, rx) = oneshot::channel();
        let task = tokio::spawn(
            Server::builder()
                .add_service(svc.server(None, None))
                .serve_with_listener(listener, async {
                    let _ = rx.await;
                }),
        );
        Srv {
            uri,
            events,
            stop,
            task,
        }
    }

    /// Calls its handlers began since the last look.
    fn calls(&mut self) -> usize {
        let mut n = 0;
        while let Ok(e) = self.events.try_recv() {
            if matches!(e, Event::Started(_)) {
                n += 1;
            }
        }
        n
    }

    async fn stop(self) {
        let _ = self.stop.send(());
        self.task.await.unwrap().unwrap();
    }
}

fn shm_uri() -> String {
    let dir = std::env::temp_dir();
    format!(
        "shm://{}/ibex-balance-{}-{}.sock",
        dir.display(),
        std::process::id(),
        rand_suffix()
    )
}

fn rand_suffix() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    N.fetch_add(1, Ordering::Relaxed)
}

#[test]
fn endpoints_are_made_as_tonic_makes_them() {
    for ok in [
        "tcp://127.0.0.1:50051",
        "tcp://[::1]:50051",
        "shm:///run/ibex.sock",
        "verbs://10.0.0.2:7000",
        "http://[::1]:50051",
        "https://example.com",
    ] {
        assert_eq!(Endpoint::from_static(ok).uri(), ok);
        assert_eq!(Channel::from_static(ok).uri(), ok);
        assert_eq!(Endpoint::from_shared(ok.to_string()).unwrap().uri(), ok);
        assert_eq!(Endpoint::try_from(ok).unwrap().uri(), ok);
        assert_eq!(Endpoint::try_from(ok.to_string()).unwrap().uri(), ok);
        assert_eq!(Endpoint::new(ok).unwrap().uri(), ok);
        assert_eq!(ok.parse::<Endpoint>().unwrap().uri(), ok);
    }
    let uri: http::Uri = "tcp://127.0.0.1:7000".parse().unwrap();
    assert_eq!(Channel::builder(uri).uri(), "tcp://127.0.0.1:7000");
    // A bad address is an error that says what is wrong with it.
    let e = Endpoint::from_shared("shm://relative.sock").unwrap_err();
    assert!(e.to_string().contains("three slashes"), "{e}");
    let e = Endpoint::new("udp://1.2.3.4:5").unwrap_err();
    assert!(e.to_string().contains("udp://1.2.3.4:5"), "{e}");
    let e = Endpoint::try_from("tcp://nohost").unwrap_err();
    assert!(e.to_string().contains("nohost"), "{e}");
    let p = std::panic::catch_unwind(|| Endpoint::from_static("tcp//oops")).unwrap_err();
    let msg = p.downcast_ref::<String>().unwrap();
    assert!(msg.contains("tcp//oops"), "{msg}");
    // Settings tonic has, chained as tonic chains them.
    let e = Endpoint::from_static("tcp://127.0.0.1:1")
        .user_agent("Greeter")
        .unwrap()
        .connect_timeout(Duration::from_secs(2))
        .tcp_keepalive(Some(Duration::from_secs(30)))
        .rate_limit(100, Duration::from_secs(1))
        .http2_max_concurrent_reset_streams(10)
        .http2_reset_stream_duration(Duration::from_secs(1))
        .origin("http://example.com".parse().unwrap());
    assert_eq!(e.get_connect_timeout(), Some(Duration::from_secs(2)));
    assert_eq!(e.get_tcp_keepalive(), Some(Duration::from_secs(30)));
    assert!(e.get_tcp_nodelay());
    assert!(
        Endpoint::from_static("tcp://127.0.0.1:1")
            .user_agent("bad\nvalue")
            .is_err()
    );
}

/// The two lines of a migration: the generated client's `connect` and `serve` on a
/// `SocketAddr`, as a tonic program writes them; the server is reachable over tcp and,
/// from this host, over shm.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn generated_connect_and_a_socket_address() {
    within(async {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        // As tonic's examples write it: the type comes from `serve`.
        let addr = format!("127.0.0.1:{port}").parse().unwrap();
        let (svc, _ev) = BenchImpl::new();
        let (stop, rx) = oneshot::channel::<()>();
        let server = tokio::spawn(
            Server::builder()
                .add_service(svc.server(None, None))
                .serve_with_shutdown(addr, async {
                    let _ = rx.await;
                }),
        );
        let uri = format!("tcp://127.0.0.1:{port}");
        // The server may not be listening yet: the first connects can be refused.
        let mut client = loop {
            match BenchClient::connect(uri.clone()).await {
                Ok(c) => break c,
                Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
            }
        };
        let want = Payload {
            buffers: vec![bytes::Bytes::from_static(b"direct")],
        };
        assert_eq!(client.echo(want.clone()).await.unwrap().into_inner(), want);
        // tonic's generated client over an Ibex channel connects the same way.
        let mut tonic_client =
            ibex_proto::bench::v1::bench_client::BenchClient::connect(uri.as_str())
                .await
                .unwrap();
        assert_eq!(
            tonic_client.echo(want.clone()).await.unwrap().into_inner(),
            want
        );
        // The server listens on every provider: a client on this host that asks for the
        // best one gets shm.
        let auto = Endpoint::new(format!("ibex://127.0.0.1:{port}"))
            .unwrap()
            .connect()
            .await
            .unwrap();
        assert_eq!(auto.connection().unwrap().provider(), "shm");
        let mut auto_client = BenchClient::new(auto);
        assert_eq!(
            auto_client.echo(want.clone()).await.unwrap().into_inner(),
            want
        );
        drop(auto_client);
        let e = BenchClient::connect("tcp://127.0.0.1:1").await.unwrap_err();
        assert!(e.to_string().contains("127.0.0.1:1"), "{e}");
        drop((client, tonic_client));
        stop.send(()).unwrap();
        server.await.unwrap().unwrap();
    })
    .await
}

/// `balance_list` over tcp and shm servers spreads calls over all of them, and passes over
/// an endpoint where nothing listens.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn balance_list_spreads_over_providers_and_skips_the_dead() {
    within(async {
        let mut servers = vec![
            Srv::start("tcp://127.0.0.1:0").await,
            Srv::start("tcp://127.0.0.1:0").await,
            Srv::start(&shm_uri()).await,
        ];
        let dead = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            format!("tcp://{}", l.local_addr().unwrap())
        };
        let mut uris: Vec<String> = servers.iter().map(|s| s.uri.clone()).collect();
        uris.push(dead);
        let channel = Channel::balance_list(uris.iter().map(|u| Endpoint::new(u).unwrap()));
        let mut client = BenchClient::new(channel);
        const CALLS: usize = 300;
        // Concurrent calls, so the less loaded of two choices matters too.
        let mut set = tokio::task::JoinSet::new();
        for _ in 0..6 {
            let mut c = client.clone();
            set.spawn(async move {
                for _ in 0..CALLS / 6 {
                    c.echo(Payload::default()).await.unwrap();
                }
            });
        }
        while let Some(r) = set.join_next().await {
            r.unwrap();
        }
        let counts: Vec<usize> = servers.iter_mut().map(Srv::calls).collect();
        assert_eq!(counts.iter().sum::<usize>(), CALLS, "{counts:?}");
        for (c, s) in counts.iter().zip(&servers) {
            assert!(
                *c >= CALLS / 10,
                "{} took only {c} of {CALLS}: {counts:?}",
                s.uri
            );
        }
        // One server goes away: calls go on over the others. A call made before the client
        // has seen that connection close may still fail `Unavailable` (as over stock
        // tonic); once it has, that endpoint is passed over.
        let gone = servers.remove(0);
        gone.stop().await;
        let mut failed = 0;
        let mut ok = 0;
        while ok < 50 {
            match client.echo(Payload::default()).await {
                Ok(_) => ok += 1,
                Err(e) => {
                    assert_eq!(e.code(), tonic::Code::Unavailable, "{e:?}");
                    failed += 1;
                    assert!(
                        failed <= 2,
                        "{failed} calls failed after one server left: {e:?}"
                    );
                }
            }
        }
        let counts: Vec<usize> = servers.iter_mut().map(Srv::calls).collect();
        assert_eq!(counts.iter().sum::<usize>(), 50, "{counts:?}");
        drop(client);
        for s in servers {
            s.stop().await;
        }
    })
    .await
}

/// `balance_channel`: endpoints inserted and removed at run time; a call made while there
/// is none waits for the first within its deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn balance_channel_follows_changes() {
    within(async {
        let mut a = Srv::start("tcp://127.0.0.1:0").await;
        let mut b = Srv::start(&shm_uri()).await;
        let (channel, tx) = Channel::balance_channel::<&'static str>(8);
        let mut client = BenchClient::new(channel);

        // No endpoint yet: a call with a short deadline fails saying so.
        let mut req = tonic::Request::new(Payload::default());
        req.set_timeout(Duration::from_millis(200));
        let e = client.echo(req).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::Unavailable, "{e:?}");
        assert!(e.message().contains("no endpoints"), "{e:?}");

        // A call waiting for the first endpoint goes to it once it comes.
        let mut waiting = client.clone();
        let call = tokio::spawn(async move { waiting.echo(Payload::default()).await });
        tokio::time::sleep(Duration::from_millis(100)).await;
        tx.send(Change::Insert("a", Endpoint::new(&a.uri).unwrap()))
            .await
            .unwrap();
        call.await.unwrap().unwrap();
        assert_eq!(a.calls(), 1);

        tx.send(Change::Insert("b", Endpoint::new(&b.uri).unwrap()))
            .await
            .unwrap();
        tx.send(Change::Remove("a")).await.unwrap();
        // Changes are applied by a task: wait until calls stop reaching `a`.
        let mut settled = false;
        for _ in 0..200 {
            client.echo(Payload::default()).await.unwrap();
            if a.calls() == 0 && b.calls() > 0 {
                settled = true;
                break;
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert!(settled, "calls never moved from the removed endpoint");
        for _ in 0..20 {
            client.echo(Payload::default()).await.unwrap();
        }
        assert_eq!(a.calls(), 0);
        assert_eq!(b.calls(), 20);
        drop((client, tx));
        a.stop().await;
        b.stop().await;
    })
    .await
}

/// After a server restart the first call that finds it back succeeds: no back-off timer
/// fails calls once the server is reachable. While the server is away, calls fail at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_first_call_after_a_restart_succeeds() {
    within(async {
        for uri in ["tcp://127.0.0.1:0".to_string(), shm_uri()] {
            let srv = Srv::start(&uri).await;
            let addr = srv.uri.clone();
            let mut client = BenchClient::connect(addr.clone()).await.unwrap();
            client.echo(Payload::default()).await.unwrap();
            srv.stop().await;
            // Several calls fail while nothing listens (each tries once).
            for _ in 0..5 {
                let t0 = std::time::Instant::now();
                let e = client.echo(Payload::default()).await.unwrap_err();
                assert_eq!(e.code(), tonic::Code::Unavailable, "{e:?}");
                assert!(t0.elapsed() < Duration::from_secs(2), "{e:?}");
            }
            let srv = Srv::start(&addr).await;
            // The very next call reaches it.
            client.echo(Payload::default()).await.unwrap();
            drop(client);
            srv.stop().await;
        }
    })
    .await
}

/// A call that finds its channel connecting to a server that accepts but never answers
/// ends at its own deadline, not the transport's set-up timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_waits_for_its_connection_within_its_deadline() {
    within(async {
        let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let uri = format!("tcp://{}", silent.local_addr().unwrap());
        let mut client = BenchClient::new(Endpoint::new(uri).unwrap().connect_lazy());
        let mut req = tonic::Request::new(Payload::default());
        req.set_timeout(Duration::from_millis(300));
        let t0 = std::time::Instant::now();
        let e = client.echo(req).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::DeadlineExceeded, "{e:?}");
        assert!(t0.elapsed() < Duration::from_secs(3), "{:?}", t0.elapsed());
        drop(silent);
    })
    .await
}
