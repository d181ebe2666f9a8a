//! End-to-end tests of the connection API, run over every provider (shm and tcp).
//!
//! Cross-process cases re-run this test binary as the peer (`IBEX_TEST_ROLE` set), so the
//! peer is a real separate process that can be killed.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use ibex_transport::{Config, Connection, Error, RecvBuf, connect, listen};

/// A hang guard, not a performance assertion. The Soft-RoCE VM (full emulation, 10–100×
/// slower) raises it with `IBEX_TEST_GUARD_SECS`.
static GUARD: std::sync::LazyLock<Duration> = std::sync::LazyLock::new(|| {
    Duration::from_secs(
        std::env::var("IBEX_TEST_GUARD_SECS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(60),
    )
});

mod conn_util;
use conn_util::{fixed_threshold, init_tracing, pattern, uri};

/// verbs tests run only in the Soft-RoCE VM; elsewhere they say so and return.
#[cfg(feature = "verbs")]
fn skip(provider: &str) -> bool {
    if provider == "verbs" && std::env::var("RXE_VM").is_err() {
        println!("skipped: no RDMA device (run scripts/verbs-test.sh)");
        return true;
    }
    false
}

fn side(config: &Config, provider: &str, var: &str) -> Config {
    let mut c = config.clone();
    if provider == "verbs" {
        c.rdma_device = std::env::var(var).ok();
    }
    c
}

async fn pair_with(provider: &str, tag: &str, config: Config) -> (Connection, Connection) {
    init_tracing();
    let l = listen(
        &uri(provider, tag),
        side(&config, provider, "IBEX_TEST_SERVER_DEV"),
    )
    .await
    .expect("listen");
    let at = l.local_uri();
    let (a, b) = tokio::join!(
        l.accept(),
        connect(&at, side(&config, provider, "IBEX_TEST_CLIENT_DEV"))
    );
    (a.expect("accept"), b.expect("connect"))
}

macro_rules! per_provider {
    ($($name:ident),* $(,)?) => {
        mod shm { $( #[tokio::test(flavor = "multi_thread", worker_threads = 2)] async fn $name() { tokio::time::timeout(*super::GUARD, super::$name("shm")).await.expect("hang guard"); } )* }
        mod tcp { $( #[tokio::test(flavor = "multi_thread", worker_threads = 2)] async fn $name() { tokio::time::timeout(*super::GUARD, super::$name("tcp")).await.expect("hang guard"); } )* }
        #[cfg(feature = "verbs")]
        mod verbs { $( #[tokio::test(flavor = "multi_thread", worker_threads = 2)] async fn $name() { if super::skip("verbs") { return; } tokio::time::timeout(*super::GUARD, super::$name("verbs")).await.expect("hang guard"); } )* }
    };
}

per_provider!(
    sizes_round_trip_intact,
    many_concurrent_senders_keep_per_sender_order,
    recv_into_lands_rendezvous_directly,
    recv_into_too_small_keeps_message,
    send_owned_returns_buffer,
    expose_and_read_remote,
    reads_past_the_link_read_depth_wait_their_turn,
    read_remote_out_of_range_is_refused,
    graceful_close_delivers_everything,
    stats_count_protocols,
    threshold_is_probed_or_set_by_the_link,
    oversize_message_is_refused,
);

/// 0 B, 1 B, threshold ± 1, a slot-sized message, and several rendezvous sizes.
async fn sizes_round_trip_intact(p: &str) {
    let t = 8192;
    let (a, b) = pair_with(p, "sizes", fixed_threshold(t)).await;
    let sizes = [
        0,
        1,
        t - 1,
        t,
        t + 1,
        60_000,
        512 * 1024,
        512 * 1024 + 1,
        3 << 20,
        16 << 20,
    ];
    let sender = {
        let a = a.clone();
        tokio::spawn(async move {
            for (i, &n) in sizes.iter().enumerate() {
                a.send(pattern(n, i as u8)).await.expect("send");
            }
        })
    };
    for (i, &n) in sizes.iter().enumerate() {
        let m = b.recv().await.expect("recv");
        assert_eq!(m.len(), n, "message {i}");
        assert_eq!(m, pattern(n, i as u8), "message {i} content");
    }
    sender.await.unwrap();
    let s = b.stats();
    assert_eq!(s.proto.eager_msgs_recv, 4, "0, 1, t-1, t are eager: {s}");
    assert_eq!(s.proto.rndv_msgs_recv, 6, "{s}");
}

async fn many_concurrent_senders_keep_per_sender_order(p: &str) {
    let (a, b) = pair_with(p, "many", fixed_threshold(4096)).await;
    let senders = 8;
    let per = 500;
    let mut tasks = Vec::new();
    for s in 0..senders {
        let a = a.clone();
        tasks.push(tokio::spawn(async move {
            for i in 0..per {
                let len = [3usize, 100, 5000, 70_000][(i + s) % 4];
                let mut v = vec![0u8; len.max(8)];
                v[..4].copy_from_slice(&(s as u32).to_le_bytes());
                v[4..8].copy_from_slice(&(i as u32).to_le_bytes());
                a.send(Bytes::from(v)).await.expect("send");
            }
        }));
    }
    let mut next = vec![0u32; senders];
    for _ in 0..senders * per {
        let m = b.recv().await.expect("recv");
        let s = u32::from_le_bytes(m[..4].try_into().unwrap()) as usize;
        let i = u32::from_le_bytes(m[4..8].try_into().unwrap());
        assert_eq!(i, next[s], "sender {s} out of order");
        next[s] += 1;
    }
    for t in tasks {
        t.await.unwrap();
    }
    assert!(next.iter().all(|&n| n as usize == per));
}

async fn recv_into_lands_rendezvous_directly(p: &str) {
    let (a, b) = pair_with(p, "into", fixed_threshold(4096)).await;
    // Post the buffer first, then send: the data must land in it with no staging copy.
    let msg = pattern(1 << 20, 7);
    let recv = posted(b.recv_into(vec![0u8; 2 << 20])).await;
    a.send(msg.clone()).await.unwrap();
    let (buf, n) = recv.await.expect("recv_into");
    assert_eq!(n, 1 << 20);
    assert_eq!(&buf[..n], &msg[..]);
    // Providers that can read into caller memory land it there directly; verbs needs
    // registered destinations and stages (registering caller receive buffers is not built yet).
    let direct = if p == "verbs" { 0 } else { 1 };
    assert_eq!(b.stats().recv_into_direct, direct, "{}", b.stats());
    // Eager messages are copied into the caller's buffer.
    a.send(Bytes::from_static(b"small")).await.unwrap();
    let (buf, n) = b.recv_into([0u8; 16]).await.unwrap();
    assert_eq!(&buf[..n], b"small");
}

/// `recv_into`, polled once: with nothing delivered yet, that poll posts its buffer, so a
/// message sent after this returns finds the buffer posted however slow the machine is (a
/// fixed wait for a spawned receiver could run out first under load). Unconstrained, so the
/// runtime's task budget cannot make that first poll return before it posts.
async fn posted<F: Future>(recv: F) -> std::pin::Pin<Box<impl Future<Output = F::Output>>> {
    let mut recv = Box::pin(tokio::task::unconstrained(recv));
    let first = std::future::poll_fn(|cx| std::task::Poll::Ready(recv.as_mut().poll(cx))).await;
    assert!(
        first.is_pending(),
        "nothing was sent yet, so nothing can be received"
    );
    recv
}

async fn recv_into_too_small_keeps_message(p: &str) {
    let (a, b) = pair_with(p, "small", fixed_threshold(4096)).await;
    a.send(pattern(100, 1)).await.unwrap();
    let e = b.recv_into(vec![0u8; 10]).await.unwrap_err();
    assert!(
        matches!(e, Error::BufferTooSmall { buf: 10, len: 100 }),
        "{e}"
    );
    assert_eq!(
        b.recv().await.unwrap(),
        pattern(100, 1),
        "message stays queued"
    );
}

async fn send_owned_returns_buffer(p: &str) {
    let (a, b) = pair_with(p, "owned", fixed_threshold(4096)).await;
    let reader = tokio::spawn(async move {
        let n = b.recv().await.map(|m| m.len());
        (b, n)
    });
    let buf: Vec<u8> = pattern(4 << 20, 3).to_vec();
    let back = a.send_owned(buf).await.expect("send_owned");
    assert_eq!(back.len(), 4 << 20);
    let (b, n) = reader.await.unwrap();
    assert_eq!(n.unwrap(), 4 << 20);
    // An eager-sized buffer comes back at once, and the message still arrives intact.
    let small = a
        .send_owned(vec![7u8; 100])
        .await
        .expect("send_owned small");
    assert_eq!(small, vec![7u8; 100]);
    assert_eq!(b.recv().await.unwrap(), Bytes::from(vec![7u8; 100]));
}

async fn expose_and_read_remote(p: &str) {
    let (a, b) = pair_with(p, "expose", fixed_threshold(4096)).await;
    let data = pattern(3 << 20, 9);
    let rb = a.expose(data.clone()).await.expect("expose");
    let got = b
        .read_remote(rb.descriptor(), RecvBuf::heap(data.len()))
        .await
        .expect("read_remote");
    assert_eq!(got.as_slice(), &data[..]);
    assert_eq!(b.stats().remote_read_bytes, data.len() as u64);
}

/// Far more fragment reads than the link takes at once (verbs: its RDMA READ depth), from
/// several `read_remote` calls and a rendezvous message together: the connection's one read
/// scheduler queues them, and every byte arrives.
async fn reads_past_the_link_read_depth_wait_their_turn(p: &str) {
    let cfg = Config {
        fragment_size: Some(64 << 10),
        ..fixed_threshold(4096)
    };
    let (a, b) = pair_with(p, "depth", cfg).await;
    let bufs: Vec<Bytes> = (0..4).map(|i| pattern(2 << 20, 20 + i)).collect();
    let mut exposed = Vec::new();
    for d in &bufs {
        exposed.push(a.expose(d.clone()).await.expect("expose"));
    }
    let msg = pattern(2 << 20, 30);
    let sender = {
        let (a, msg) = (a.clone(), msg.clone());
        tokio::spawn(async move { a.send(msg).await })
    };
    let reads = exposed.iter().map(|rb| {
        let b = b.clone();
        let d = rb.descriptor();
        async move { b.read_remote(d, RecvBuf::heap(2 << 20)).await }
    });
    let got = futures_util::future::join_all(reads).await;
    for (i, (g, want)) in got.into_iter().zip(&bufs).enumerate() {
        assert_eq!(g.expect("read_remote").as_slice(), &want[..], "read {i}");
    }
    assert_eq!(b.recv().await.expect("recv"), msg);
    sender.await.expect("sender").expect("send");
    assert_eq!(b.stats().remote_read_bytes, 4 * (2 << 20));
}

async fn read_remote_out_of_range_is_refused(p: &str) {
    let (a, b) = pair_with(p, "range", fixed_threshold(4096)).await;
    let rb = a.expose(pattern(1000, 1)).await.unwrap();
    let e = b
        .read_remote(rb.descriptor(), RecvBuf::heap(5000))
        .await
        .expect_err("past the end must fail");
    let text = e.to_string();
    assert!(!text.is_empty());
    let garbage = Bytes::from_static(&[0xff; 5]);
    assert!(
        b.read_remote(garbage, RecvBuf::heap(10)).await.is_err(),
        "garbage descriptor must fail"
    );
}

async fn graceful_close_delivers_everything(p: &str) {
    let (a, b) = pair_with(p, "close", fixed_threshold(4096)).await;
    for i in 0..20u8 {
        a.send(pattern(if i % 2 == 0 { 10 } else { 200_000 }, i))
            .await
            .unwrap();
    }
    a.close().await;
    for i in 0..20u8 {
        let m = b
            .recv()
            .await
            .expect("queued messages survive a graceful close");
        assert_eq!(m, pattern(if i % 2 == 0 { 10 } else { 200_000 }, i));
    }
    let e = b.recv().await.unwrap_err();
    assert!(matches!(e, Error::PeerClosed(_)), "{e}");
    assert!(a.send(Bytes::from_static(b"x")).await.is_err());
}

async fn stats_count_protocols(p: &str) {
    let (a, b) = pair_with(p, "stats", fixed_threshold(1000)).await;
    for _ in 0..10 {
        a.send(pattern(10, 0)).await.unwrap();
    }
    a.send(pattern(100_000, 0)).await.unwrap();
    for _ in 0..11 {
        b.recv().await.unwrap();
    }
    let (sa, sb) = (a.stats(), b.stats());
    assert_eq!(sa.proto.eager_msgs_sent, 10, "{sa}");
    assert_eq!(sa.proto.rndv_msgs_sent, 1, "{sa}");
    assert_eq!(sa.proto.rndv_bytes_sent, 100_000);
    assert_eq!(sb.proto.eager_bytes_recv, 100);
    assert_eq!(sb.proto.eager_threshold, 1000);
    assert_eq!(sb.provider, p);
    assert!(!sb.rendezvous_path.is_empty());
}

async fn threshold_is_probed_or_set_by_the_link(p: &str) {
    // From the environment, as users build it (the VM harness raises the probe's time limit).
    let cfg = Config {
        eager_threshold: None,
        fragment_size: None,
        probe: true,
        ..Config::from_env().expect("config")
    };
    let (a, b) = pair_with(p, "probe", cfg.clone()).await;
    // Each end probes its own way out.
    for (side, c) in [("server", &a), ("client", &b)] {
        let t = c.probe_done().await;
        let s = c.stats();
        println!("{p} {side}: {s}");
        if p == "verbs" {
            // RDMA reads can beat a copy through a slot: the crossover is measured.
            assert!(t >= 1024 && t <= cfg.max_eager(), "threshold {t}");
            assert_eq!(s.proto.threshold_source, "probe", "{s}");
        } else {
            // A read on shm (CMA) or tcp is a CPU copy and a round trip: eager up to the
            // slot, whatever a probe would have sampled.
            assert_eq!(t, cfg.max_eager(), "{s}");
            assert_eq!(s.proto.threshold_source, "link", "{s}");
        }
        if p == "verbs" {
            // Both ends are this build, so on RDMA the fragment size is probed as well.
            assert_eq!(s.proto.fragment_source, "probe", "{s}");
            assert!(
                ibex_transport::proto::FRAGMENT_CANDIDATES.contains(&s.proto.fragment_size),
                "{s}"
            );
        } else {
            // shm and tcp skip the fragment probe: it does not pay there.
            assert_eq!(s.proto.fragment_source, "default", "{s}");
            assert_eq!(s.proto.fragment_size, cfg.default_fragment_size, "{s}");
        }
    }
    // Probe traffic never reaches the application.
    a.send(Bytes::from_static(b"first")).await.unwrap();
    assert_eq!(b.recv().await.unwrap(), Bytes::from_static(b"first"));
}

async fn oversize_message_is_refused(p: &str) {
    let cfg = Config {
        max_message_size: 1 << 20,
        ..fixed_threshold(4096)
    };
    let (a, _b) = pair_with(p, "oversize", cfg).await;
    let e = a.send(pattern(2 << 20, 0)).await.unwrap_err();
    assert!(matches!(e, Error::TooLarge { .. }), "{e}");
    assert!(e.to_string().contains("max_message_size"), "{e}");
}

/// A listener closed with `close` has let go of its port when `close` returns, so a server
/// restarted at the same address binds at once (a drop closes the socket a moment later).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closed_listener_frees_its_address_at_once() {
    let first = listen("tcp://127.0.0.1:0", Config::default())
        .await
        .unwrap();
    let addr = first.local_uri();
    let peer = connect(&addr, Config::default());
    let (accepted, dialed) = tokio::join!(first.accept(), peer);
    let (accepted, dialed) = (accepted.unwrap(), dialed.unwrap());
    first.close().await;
    for i in 0..50 {
        let l = listen(&addr, Config::default())
            .await
            .unwrap_or_else(|e| panic!("round {i}: {addr} still in use after close: {e}"));
        l.close().await;
    }
    // The connection made before is not the listener's: it still works.
    dialed.send(Bytes::from_static(b"after")).await.unwrap();
    assert_eq!(accepted.recv().await.unwrap(), Bytes::from_static(b"after"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shm_pool_buffers_move_without_copy() {
    let (a, b) = pair_with("shm", "pool", fixed_threshold(4096)).await;
    let mut buf = a.alloc(8 << 20).expect("pool alloc");
    buf.iter_mut().enumerate().for_each(|(i, x)| *x = i as u8);
    let bytes = buf.freeze();
    a.send(bytes.clone()).await.unwrap();
    let m = b.recv().await.unwrap();
    assert_eq!(m, bytes);
    let s = b.stats();
    assert_eq!(s.rndv_mapped_msgs, 1, "{s}");
    assert_eq!(
        s.payload_bytes_copied(),
        0,
        "pool buffers must not be copied: {s}"
    );
    // The sender's buffer comes back once the receiver drops its view.
    let free_before = a.pool().unwrap().free_bytes();
    drop(bytes);
    drop(m);
    let pool = a.pool().unwrap();
    // The release travels to the sender, which a loaded machine may take a while to do.
    let until = std::time::Instant::now() + Duration::from_secs(30);
    while std::time::Instant::now() < until {
        if pool.free_bytes() > free_before {
            break;
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(
        pool.free_bytes() > free_before,
        "pool buffer was not released after the view was dropped"
    );
}

/// Connections from another process share one pool per side, and each side maps the
/// other's once: the child dials three times and sends one pool buffer over all three; here
/// the three arrive as views of the same mapping (same address), with no copy, and the
/// three accepted connections carve one pool. The child checks the same of ours.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shm_connections_from_another_process_share_one_pool() {
    init_tracing();
    let cfg = fixed_threshold(4096);
    let l = listen(&uri("shm", "xproc"), cfg).await.expect("listen");
    let kid = std::process::Command::new(std::env::current_exe().expect("current_exe"))
        .args([
            "--exact",
            "shm_pool_sharing_dialer",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("IBEX_TEST_AT", l.local_uri())
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("spawning the dialing process");
    let mut conns = Vec::new();
    for _ in 0..3 {
        conns.push(l.accept().await.expect("accept"));
    }
    let pool = conns[0].pool().unwrap();
    let mut addrs = Vec::new();
    for c in &conns {
        assert!(
            Arc::ptr_eq(&c.pool().unwrap(), &pool),
            "one pool for the pair"
        );
        let m = c.recv().await.unwrap();
        assert_eq!(m, pattern(1 << 20, 9));
        addrs.push(m.as_ptr() as usize);
        let st = c.stats();
        assert_eq!(st.rndv_mapped_msgs, 1, "{st}");
        assert_eq!(st.payload_bytes_copied(), 0, "{st}");
    }
    assert!(
        addrs.iter().all(|&a| a == addrs[0]),
        "the peer's pool is mapped once: {addrs:x?}"
    );
    let mut reply = conns[0].alloc(1 << 20).unwrap();
    reply.copy_from_slice(&pattern(1 << 20, 4));
    let reply = reply.freeze();
    for c in &conns {
        c.send(reply.clone()).await.unwrap();
    }
    let out = tokio::task::spawn_blocking(move || kid.wait_with_output())
        .await
        .unwrap()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout) + String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success() && text.contains("1 passed"),
        "the dialing process failed:\n{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "helper: run by shm_connections_from_another_process_share_one_pool in a process of its own"]
async fn shm_pool_sharing_dialer() {
    let at = std::env::var("IBEX_TEST_AT").expect("IBEX_TEST_AT");
    let mut conns = Vec::new();
    for _ in 0..3 {
        conns.push(connect(&at, fixed_threshold(4096)).await.expect("connect"));
    }
    let pool = conns[0].pool().unwrap();
    let mut buf = conns[0].alloc(1 << 20).unwrap();
    buf.copy_from_slice(&pattern(1 << 20, 9));
    let buf = buf.freeze();
    for c in &conns {
        assert!(
            Arc::ptr_eq(&c.pool().unwrap(), &pool),
            "one pool for the pair"
        );
        c.send(buf.clone()).await.unwrap();
    }
    let mut addrs = Vec::new();
    for c in &conns {
        let m = c.recv().await.unwrap();
        assert_eq!(m, pattern(1 << 20, 4));
        addrs.push(m.as_ptr() as usize);
        assert_eq!(c.stats().payload_bytes_copied(), 0);
    }
    assert!(addrs.iter().all(|&a| a == addrs[0]), "{addrs:x?}");
    for c in &conns {
        c.close().await;
    }
}

/// The size from which a buffer goes by descriptor comes from the connection: half a
/// fragment and at least twice the eager threshold where reads are direct (CMA, and tcp's
/// stream into the destination).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_min_derives_from_the_connection() {
    let (a, b) = pair_with("shm", "remotemin", fixed_threshold(4096)).await;
    let (threshold, fragment) = a.message_sizes();
    assert_eq!(a.remote_min(), Some((fragment / 2).max(2 * threshold)));
    assert_eq!(b.remote_min(), a.remote_min());
    let big = Config {
        slot_size: 512 << 10,
        fragment_size: Some(128 << 10),
        ..fixed_threshold(256 << 10)
    };
    let (c, _d) = pair_with("shm", "remotemin2", big).await;
    assert_eq!(
        c.remote_min(),
        Some(512 << 10),
        "never below twice the eager threshold"
    );
    let (t, u) = pair_with("tcp", "remotemin", fixed_threshold(4096)).await;
    let (threshold, fragment) = t.message_sizes();
    assert_eq!(t.remote_min(), Some((fragment / 2).max(2 * threshold)));
    assert_eq!(u.remote_min(), t.remote_min());
}

/// tcp pushes message bodies behind their RTS. With a receive budget far below what is in
/// flight, the receiver defers most announcements, so their pushes come before their reads:
/// the link holds them (4 MiB at most) and drops the rest, which are then read by asking.
/// Every message still arrives whole and in order, pushed or not (2 MiB + 1 is not).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tcp_pushes_before_their_reads_are_held_or_dropped_and_nothing_is_lost() {
    tokio::time::timeout(*GUARD, async {
        let config = Config {
            rndv_recv_budget: 256 << 10,
            ..fixed_threshold(4096)
        };
        let (a, b) = pair_with("tcp", "pushheld", config).await;
        let sizes = [100_000, 700_000, 2 << 20, (2 << 20) + 1, 1_500_000];
        let n = 24;
        // Made before anything is sent: in a debug build on a loaded machine, making 31 MB
        // of pattern between sends held the pushes back until the reads had begun.
        let messages: Vec<Bytes> = (0..n)
            .map(|i| pattern(sizes[i % sizes.len()], i as u8))
            .collect();
        let sender = tokio::spawn(async move {
            for m in messages {
                a.send(m).await.expect("send");
            }
            a
        });
        // Let the announcements arrive and wait behind the budget first, until the link
        // has held all it may and dropped a push: that, not a fixed time, is what the
        // rest needs, however slowly a loaded machine gets there.
        let held_all = tokio::time::Instant::now() + Duration::from_secs(30);
        while b.stats().pushes.dropped == 0 && tokio::time::Instant::now() < held_all {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        for i in 0..n {
            let m = b.recv().await.expect("recv");
            let len = sizes[i % sizes.len()];
            assert_eq!(m.len(), len, "message {i}");
            assert!(m == pattern(len, i as u8), "message {i} content");
        }
        let a = sender.await.unwrap();
        assert_eq!(a.stats().pushes.sent, 19);
        let s = b.stats();
        assert!(
            s.proto.rndv_recv_deferred > 0,
            "the budget deferred nothing: {s}"
        );
        let q = s.pushes;
        assert!(q.held > 0 && q.dropped > 0 && q.asked > 0, "{s}");
        assert_eq!(
            q.direct + q.held + q.dropped,
            (0..n).filter(|i| sizes[i % sizes.len()] <= 2 << 20).count() as u64,
            "every body of 2 MiB or less was pushed, and one of the three befell each: {s}"
        );
        assert!(s.to_string().contains("held"), "{s}");
    })
    .await
    .expect("hang guard");
}

/// Whoever waits, reads: with a budget of `INLINE_READ_MIN_SPIN` or more, a receiver waiting
/// for a reply reads it from the link on its own task, and runs the copies of a rendezvous
/// message it read that way itself; under it the driver task spins and delivers
/// everything.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_receiver_reads_the_link_itself() {
    for (spin, tag) in [
        (Duration::from_millis(5), "inline"),
        (Duration::from_micros(50), "noinline"),
    ] {
        let config = Config {
            spin,
            ..fixed_threshold(4096)
        };
        let (a, b) = pair_with("shm", tag, config).await;
        let echo = tokio::spawn(async move {
            for _ in 0..200 {
                let m = b.recv().await.unwrap();
                b.send(m).await.unwrap();
            }
            b
        });
        // Every fourth a rendezvous message: read inline, its RTS posts reads that are
        // link work, which the receiver runs once it lets go of the lock. Made beforehand,
        // so the peer answers within any spin budget.
        let big = pattern(300 << 10, 9);
        for i in 0..200u32 {
            let m = if i % 4 == 3 {
                big.clone()
            } else {
                Bytes::from(i.to_be_bytes().to_vec())
            };
            a.send(m.clone()).await.unwrap();
            assert_eq!(a.recv().await.unwrap(), m);
        }
        let b = echo.await.unwrap();
        let (ra, rb) = (a.stats().inline_reads, b.stats().inline_reads);
        let copies = a.stats().inline_copies + b.stats().inline_copies;
        if spin < ibex_transport::config::INLINE_READ_MIN_SPIN {
            assert_eq!((ra, rb), (0, 0), "a short budget: the driver delivers");
            assert_eq!(copies, 0, "and the driver copies");
        } else {
            // 2 x 50 messages of 300 KiB, each read in fragments of at least 64 KiB: most
            // RTS come to a spinning receiver, which copies them.
            assert!(copies >= 20, "copies run by receivers: {copies}");
            // A generous budget on an idle pair: most eager replies come within it. Not
            // all: a receiver that finds its message already delivered takes it as is, and
            // while the driver runs a rendezvous message's reads it may take the next one
            // (how many depends on timing, so the bound is loose).
            assert!(
                ra + rb >= 30,
                "inline reads: {ra} and {rb} of 2 x 150 eager messages"
            );
        }
    }
}

/// A receiver that starts spinning on the link and then stops polling (its future dropped
/// mid-spin) must not leave the link to nobody: the driver takes it back when the lease
/// runs out, so a rendezvous message, which only the driver completes when no one is
/// receiving, still arrives and its sender learns it did.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receiver_that_stops_spinning_hands_the_link_back() {
    let config = Config {
        spin: Duration::from_millis(20),
        ..fixed_threshold(4096)
    };
    let (a, b) = pair_with("shm", "handback", config).await;
    for _ in 0..3 {
        // Poll once (the receiver starts its spin and disarms the link), then drop it.
        let waker = std::task::Waker::noop();
        let mut cx = std::task::Context::from_waker(waker);
        assert!(a.poll_recv(&mut cx).is_pending());
        tokio::time::sleep(Duration::from_millis(1)).await;
        let big = pattern(256 << 10, 7);
        tokio::time::timeout(Duration::from_secs(10), b.send_wait(big.clone()))
            .await
            .expect("the sender learned the receiver has its data")
            .unwrap();
        assert_eq!(a.recv().await.unwrap(), big);
    }
}

/// All shm connections between the same two processes share one pool per side (here the
/// "two processes" are the dialing and the accepting ends of this one): a buffer carved for
/// one connection moves with no copy over another, and both directions keep working at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shm_connections_of_one_process_pair_share_one_pool() {
    init_tracing();
    let cfg = fixed_threshold(4096);
    let l = listen(&uri("shm", "sharedpool"), cfg.clone())
        .await
        .expect("listen");
    let at = l.local_uri();
    let mut pairs = Vec::new();
    for _ in 0..3 {
        let (s, c) = tokio::join!(l.accept(), connect(&at, cfg.clone()));
        pairs.push((c.expect("connect"), s.expect("accept")));
    }
    let dial = pairs[0].0.pool().unwrap();
    let acc = pairs[0].1.pool().unwrap();
    assert!(
        !Arc::ptr_eq(&dial, &acc),
        "the two ends carve separate pools"
    );
    for (c, s) in &pairs[1..] {
        assert!(Arc::ptr_eq(&c.pool().unwrap(), &dial), "dialing ends share");
        assert!(
            Arc::ptr_eq(&s.pool().unwrap(), &acc),
            "accepting ends share"
        );
    }

    // Carved on connection 0, sent on 1 and 2 at once, both ways.
    let mut jobs = Vec::new();
    for (i, (c, s)) in pairs.iter().enumerate().skip(1) {
        let mut up = pairs[0].0.alloc(3 << 20).expect("pool alloc");
        up.iter_mut()
            .enumerate()
            .for_each(|(j, x)| *x = (j * 7 + i) as u8);
        let up = up.freeze();
        let mut down = pairs[0].1.alloc(2 << 20).expect("pool alloc");
        down.iter_mut()
            .enumerate()
            .for_each(|(j, x)| *x = (j * 13 + i) as u8);
        let down = down.freeze();
        let (c, s) = (c.clone(), s.clone());
        jobs.push(tokio::spawn(async move {
            let (a, b) = tokio::join!(c.send(up.clone()), s.send(down.clone()));
            a.unwrap();
            b.unwrap();
            let (got_up, got_down) = tokio::join!(s.recv(), c.recv());
            assert_eq!(got_up.unwrap(), up);
            assert_eq!(got_down.unwrap(), down);
            for side in [&c, &s] {
                let st = side.stats();
                assert_eq!(st.rndv_mapped_msgs, 1, "{st}");
                assert_eq!(st.payload_bytes_copied(), 0, "{st}");
            }
        }));
    }
    for j in jobs {
        j.await.expect("transfer");
    }
    // Closing one connection leaves the pool to the others.
    let (c0, s0) = pairs.remove(0);
    c0.close().await;
    drop((c0, s0));
    let (c, s) = &pairs[0];
    let buf = c.alloc(1 << 20).expect("pool alloc after a close").freeze();
    c.send(buf.clone()).await.unwrap();
    assert_eq!(s.recv().await.unwrap(), buf);
}

#[tokio::test]
async fn bad_addresses_are_explained() {
    let e = connect("udp://x:1", Config::default())
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("unknown scheme"), "{e}");
    let e = connect("shm:///nonexistent/ibex.sock", Config::default())
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("/nonexistent/ibex.sock"), "{e}");
    let e = connect("tcp://127.0.0.1:1", Config::default())
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("127.0.0.1:1"), "{e}");
}

#[test]
fn connect_auto_prefers_shm_on_the_same_host() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let dir = tempdir();
        let cfg = Config {
            shm_dir: dir.clone(),
            ..fixed_threshold(4096)
        };
        let l = ibex_transport::listen_auto("127.0.0.1:0", cfg.clone())
            .await
            .unwrap();
        let port = l.local_uri().rsplit(':').next().unwrap().to_string();
        let uri = ibex_transport::choose_auto(&format!("127.0.0.1:{port}"), &cfg).unwrap();
        assert!(uri.starts_with("shm://"), "{uri}");
        assert_eq!(
            ibex_transport::choose_auto("192.0.2.9:80", &cfg).unwrap(),
            "tcp://192.0.2.9:80"
        );
        let forced = Config {
            auto_transport: Some("tcp".into()),
            ..cfg.clone()
        };
        assert_eq!(
            ibex_transport::choose_auto(&format!("127.0.0.1:{port}"), &forced).unwrap(),
            format!("tcp://127.0.0.1:{port}")
        );
        let hp = format!("127.0.0.1:{port}");
        let (a, b) = tokio::join!(l.accept(), ibex_transport::connect_auto(&hp, cfg.clone()));
        assert_eq!(b.unwrap().provider(), "shm");
        assert_eq!(a.unwrap().provider(), "shm");
        drop(l);
        let _ = std::fs::remove_dir_all(&dir);
    });
}

fn tempdir() -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("ibex-auto-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}
