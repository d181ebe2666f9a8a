//! Hostile peers at the gRPC call layer, over shm and tcp: a scripted client that opens an
//! honest Ibex connection and then writes the call framing (`grpc/wire.rs`) by hand,
//! while an honest tonic client keeps making verified calls on the same server.
//!
//! Each bad packet costs only its sender: the connection is closed with a reason naming
//! the defect where the framing cannot go on, or the one call is refused with a status
//! naming the limit where it can. Nothing panics anywhere in the process.

mod grpc_common;
mod hostile_util;

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use bytes::{BufMut, Bytes, BytesMut};
use grpc_common::transports::{ibex_config, shm_uri};
use grpc_common::{BenchImpl, pattern};
use ibex_proto::bench::v1::Payload;
use ibex_proto::bench::v1::bench_ibex::BenchClient;
use ibex_transport::Connection;
use prost::Message;

const HEAD: u8 = 1;
const DATA: u8 = 2;
const DATA_NEXT: u8 = 4;
const TRAILERS: u8 = 8;
const END: u8 = 16;
const RESET: u8 = 32;
const WINDOW: u8 = 64;

/// The server's calls-in-flight limit here.
const MAX_CALLS: usize = 16;
/// A hang guard, not a performance assertion.
const WITHIN: Duration = Duration::from_secs(20);

fn headers(b: &mut BytesMut, count: u16, list: &[(&str, &[u8])]) {
    b.put_u16(count);
    for (n, v) in list {
        b.put_u16(n.len() as u16);
        b.put_slice(n.as_bytes());
        b.put_u32(v.len() as u32);
        b.put_slice(v);
    }
}

/// A request head for `method` of the Bench service, as the wire format defines it.
fn head_block(method: &str, count: u16, list: &[(&str, &[u8])]) -> Bytes {
    let path = format!("/ibex.bench.v1.Bench/{method}");
    let mut b = BytesMut::new();
    b.put_u16(path.len() as u16);
    b.put_slice(path.as_bytes());
    headers(&mut b, count, list);
    b.freeze()
}

const GRPC: &[(&str, &[u8])] = &[("content-type", b"application/grpc"), ("te", b"trailers")];

/// A packet: sections in flag order.
fn packet(
    call: u32,
    head: Option<Bytes>,
    data: Option<&[u8]>,
    next: Option<u64>,
    flags: u8,
) -> Bytes {
    let mut b = BytesMut::new();
    b.put_u32(call);
    let mut f = flags;
    b.put_u8(0);
    if let Some(h) = head {
        f |= HEAD;
        b.put_u32(h.len() as u32);
        b.put_slice(&h);
    }
    if let Some(d) = data {
        f |= DATA;
        b.put_u32(d.len() as u32);
        b.put_slice(d);
    }
    if let Some(n) = next {
        f |= DATA_NEXT;
        b.put_u64(n);
    }
    b[4] = f;
    b.freeze()
}

/// One gRPC message (5-byte prefix) carrying a `Payload` of `len` bytes.
fn grpc_message(len: usize) -> Bytes {
    let p = Payload {
        buffers: vec![pattern(len, 3)],
    }
    .encode_to_vec();
    let mut b = BytesMut::with_capacity(5 + p.len());
    b.put_u8(0);
    b.put_u32(p.len() as u32);
    b.put_slice(&p);
    b.freeze()
}

/// The `grpc-status` a server packet carries for `call`, if any. `next` is set when the
/// packet says its body is the next message.
fn status_in(mut m: &[u8], call: u32, next: &mut bool) -> Option<String> {
    fn u32_of(m: &mut &[u8]) -> Option<u32> {
        let (a, rest) = m.split_first_chunk::<4>()?;
        *m = rest;
        Some(u32::from_be_bytes(*a))
    }
    fn list(mut h: &[u8]) -> Option<String> {
        let (c, rest) = h.split_first_chunk::<2>()?;
        h = rest;
        let mut found = None;
        for _ in 0..u16::from_be_bytes(*c) {
            let (nl, rest) = h.split_first_chunk::<2>()?;
            let nl = u16::from_be_bytes(*nl) as usize;
            let name = rest.get(..nl)?;
            let mut r = &rest[nl..];
            let vl = u32_of(&mut r)? as usize;
            let value = r.get(..vl)?;
            if name == b"grpc-status" {
                found = Some(String::from_utf8_lossy(value).into_owned());
            }
            h = &r[vl..];
        }
        found
    }
    let id = u32_of(&mut m)?;
    let (&flags, rest) = m.split_first()?;
    m = rest;
    let mut status = None;
    if flags & HEAD != 0 {
        let len = u32_of(&mut m)? as usize;
        let block = m.get(..len)?;
        status = status.or(list(block.get(2..)?));
        m = &m[len..];
    }
    if flags & DATA != 0 {
        let len = u32_of(&mut m)? as usize;
        m = m.get(len..)?;
    }
    if flags & DATA_NEXT != 0 {
        *next = true;
        m = m.get(8..)?;
    }
    if flags & TRAILERS != 0 {
        let len = u32_of(&mut m)? as usize;
        status = status.or(list(m.get(..len)?));
    }
    (id == call).then_some(status).flatten()
}

/// Reads until the server answers `call` with a status; `Err` if the connection ends.
async fn status_of(c: &Connection, call: u32) -> Result<String, String> {
    let t = Instant::now();
    let mut skip = false;
    loop {
        let left = WITHIN.saturating_sub(t.elapsed());
        let m = tokio::time::timeout(left, c.recv())
            .await
            .unwrap_or_else(|_| panic!("no answer to call {call} within {WITHIN:?}"))
            .map_err(|e| e.to_string())?;
        if std::mem::take(&mut skip) {
            continue; // a body that travelled as its own message
        }
        if let Some(s) = status_in(&m, call, &mut skip) {
            return Ok(s);
        }
    }
}

/// Reads until the server has answered every call in `calls` with a status, in whatever
/// order the answers come; `Err` if the connection ends.
async fn statuses_of(c: &Connection, calls: &[u32]) -> Result<Vec<String>, String> {
    let t = Instant::now();
    let mut got: Vec<Option<String>> = vec![None; calls.len()];
    let mut skip = false;
    while got.iter().any(Option::is_none) {
        let left = WITHIN.saturating_sub(t.elapsed());
        let m = tokio::time::timeout(left, c.recv())
            .await
            .unwrap_or_else(|_| panic!("calls {calls:?}: answers {got:?} after {WITHIN:?}"))
            .map_err(|e| e.to_string())?;
        if std::mem::take(&mut skip) {
            continue;
        }
        for (i, &call) in calls.iter().enumerate() {
            let mut next = false;
            if let Some(st) = status_in(&m, call, &mut next) {
                got[i] = Some(st);
            }
            skip |= next;
        }
    }
    Ok(got.into_iter().flatten().collect())
}

/// Reads until the server closes the connection; returns the reason it gave.
async fn closed(c: &Connection) -> String {
    let end = async {
        loop {
            if let Err(e) = c.recv().await {
                return e.to_string();
            }
        }
    };
    tokio::time::timeout(WITHIN, end)
        .await
        .expect("the server left a bad peer's connection open")
}

struct Honest {
    done: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<Result<u64, String>>,
}

impl Honest {
    async fn start(uri: &str) -> Honest {
        let ch = ibex_transport::grpc::Channel::connect_with_config(uri, ibex_config())
            .await
            .expect("the honest client connects");
        let mut client = BenchClient::new(ch);
        let done = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let (d, s) = (done.clone(), stop.clone());
        let task = tokio::spawn(async move {
            let mut i = 0u64;
            while !s.load(Ordering::Relaxed) {
                let want = Payload {
                    buffers: vec![pattern([16usize, 2000, 40 << 10][i as usize % 3], i as u8)],
                };
                let got = client
                    .echo(want.clone())
                    .await
                    .map_err(|e| format!("call {i}: {e}"))?
                    .into_inner();
                if got != want {
                    return Err(format!("call {i} came back different"));
                }
                i += 1;
                d.store(i, Ordering::Relaxed);
            }
            Ok(i)
        });
        Honest { done, stop, task }
    }

    async fn served(&self, while_: &str) {
        self.served_within(while_, WITHIN).await
    }

    /// Two more of the honest client's calls are answered within `within`.
    async fn served_within(&self, while_: &str, within: Duration) {
        let from = self.done.load(Ordering::Relaxed);
        let t = Instant::now();
        while self.done.load(Ordering::Relaxed) < from + 2 {
            assert!(
                !self.task.is_finished(),
                "the honest client stopped while {while_}"
            );
            assert!(
                t.elapsed() < within,
                "the honest client was not served within {within:?} while {while_}"
            );
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }

    async fn finish(self) -> u64 {
        self.stop.store(true, Ordering::Relaxed);
        self.task
            .await
            .expect("the honest client's task")
            .unwrap_or_else(|e| panic!("the honest client failed: {e}"))
    }
}

/// Listens on `listen_uri` and serves `builder` there until the returned sender fires or
/// is dropped.
async fn serve(
    listen_uri: &str,
    config: ibex_transport::Config,
    builder: ibex_transport::grpc::Builder,
) -> (
    String,
    tokio::sync::oneshot::Sender<()>,
    tokio::task::JoinHandle<ibex_transport::Result<()>>,
) {
    let listener = ibex_transport::listen(listen_uri, config)
        .await
        .expect("listen");
    let uri = listener.local_uri();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(builder.serve_with_listener(listener, async {
        let _ = stop_rx.await;
    }));
    (uri, stop_tx, server)
}

async fn suite(listen_uri: &str) {
    hostile_util::count_panics();
    let (svc, _events) = BenchImpl::new();
    let builder = ibex_transport::grpc::Server::builder()
        .max_concurrent_calls(MAX_CALLS)
        .add_service(svc.server(Some(64 << 20), None));
    let (uri, stop_tx, server) = serve(listen_uri, ibex_config(), builder).await;
    let honest = Honest::start(&uri).await;
    honest.served("warming up").await;
    let raw = || async {
        ibex_transport::connect(&uri, ibex_config())
            .await
            .expect("raw connect")
    };
    let echo = |call| {
        packet(
            call,
            Some(head_block("Echo", 2, GRPC)),
            Some(&grpc_message(8)),
            None,
            END,
        )
    };
    let mut cases = 0;

    // A header count of 40000, which panics `http`'s HeaderMap if allocated unchecked.
    let c = raw().await;
    c.send(packet(
        1,
        Some(head_block("Echo", 40000, GRPC)),
        None,
        None,
        END,
    ))
    .await
    .unwrap();
    let why = closed(&c).await;
    assert!(
        why.contains("header"),
        "header count 40000: closed with {why:?}"
    );
    honest.served("a header count of 40000").await;
    cases += 1;

    // A header list over the 16 KiB limit.
    let c = raw().await;
    let big = vec![b'a'; 20 << 10];
    c.send(packet(
        1,
        Some(head_block("Echo", 1, &[("x-big", &big)])),
        None,
        None,
        END,
    ))
    .await
    .unwrap();
    let why = closed(&c).await;
    assert!(
        why.contains("header list"),
        "a 20 KiB header list: closed with {why:?}"
    );
    honest.served("a 20 KiB header list").await;
    cases += 1;

    // A call id opened twice.
    let c = raw().await;
    c.send(packet(
        3,
        Some(head_block("Upload", 2, GRPC)),
        None,
        None,
        0,
    ))
    .await
    .unwrap();
    c.send(packet(
        3,
        Some(head_block("Upload", 2, GRPC)),
        None,
        None,
        0,
    ))
    .await
    .unwrap();
    let why = closed(&c).await;
    assert!(
        why.contains("opened twice"),
        "a duplicate call id: closed with {why:?}"
    );
    honest.served("a duplicate call id").await;
    cases += 1;

    // A body past the call's 8 MiB window: a handler that never reads, 9 MiB (one frame
    // may overshoot what is left), then one byte more. A flow-control error, as in HTTP/2:
    // the connection is closed naming the window.
    let c = raw().await;
    let hold: &[(&str, &[u8])] = &[("content-type", b"application/grpc"), ("x-mode", b"hold")];
    let body = grpc_message(9 << 20);
    c.send_parts(
        packet(
            5,
            Some(head_block("Upload", 2, hold)),
            None,
            Some(body.len() as u64),
            0,
        ),
        body,
    )
    .await
    .unwrap();
    c.send(packet(5, None, Some(b"x"), None, 0)).await.unwrap();
    let why = closed(&c).await;
    assert!(
        why.contains("flow-control window"),
        "a window overrun: closed with {why:?}"
    );
    honest.served("a window overrun").await;
    cases += 1;

    // Data, window credit, trailers and a reset for calls never opened are dropped (they may race
    // with a call's end); the connection goes on.
    let c = raw().await;
    c.send(packet(99, None, Some(b"stray"), None, END))
        .await
        .unwrap();
    c.send(packet(98, None, None, None, RESET)).await.unwrap();
    let mut w = BytesMut::new();
    w.put_u32(97);
    w.put_u8(WINDOW);
    w.put_u32(u32::MAX);
    c.send(w.freeze()).await.unwrap();
    let mut t = BytesMut::new();
    t.put_u32(15);
    t.put_u8(TRAILERS);
    t.put_u32(2);
    t.put_u16(0);
    c.send(t.freeze()).await.unwrap();
    c.send(echo(9)).await.unwrap();
    assert_eq!(
        status_of(&c, 9).await.as_deref(),
        Ok("0"),
        "a call after stray packets"
    );
    honest.served("stray packets").await;
    cases += 1;

    // Calls past the limit are refused one by one (answers may come in any order); the
    // held ones end when reset.
    let c = raw().await;
    let held = MAX_CALLS as u32 + 4;
    for id in 0..held {
        c.send(packet(
            101 + id,
            Some(head_block("Upload", 2, GRPC)),
            None,
            None,
            0,
        ))
        .await
        .unwrap();
    }
    let past: Vec<u32> = (MAX_CALLS as u32..held).map(|id| 101 + id).collect();
    assert_eq!(
        statuses_of(&c, &past).await,
        Ok(vec!["8".to_string(); past.len()]),
        "calls past the limit are refused with RESOURCE_EXHAUSTED"
    );
    for id in 0..MAX_CALLS as u32 {
        c.send(packet(101 + id, None, None, None, RESET))
            .await
            .unwrap();
    }
    c.send(echo(1001)).await.unwrap();
    assert_eq!(
        status_of(&c, 1001).await.as_deref(),
        Ok("0"),
        "a call after the limit cleared"
    );
    honest.served("calls past the limit").await;
    cases += 1;

    // A body announced at 1 PiB.
    let c = raw().await;
    c.send(packet(
        11,
        Some(head_block("Upload", 2, GRPC)),
        None,
        Some(1 << 50),
        0,
    ))
    .await
    .unwrap();
    let why = closed(&c).await;
    assert!(
        !why.is_empty(),
        "a 1 PiB body announcement: closed without a reason"
    );
    honest.served("a 1 PiB body announcement").await;
    cases += 1;

    // A truncated packet, a head past the packet's end, and an unparseable method path.
    for (what, p) in [
        ("a 3-byte packet", Bytes::from_static(&[0, 0, 1])),
        ("a head that runs past the packet", {
            let mut b = BytesMut::new();
            b.put_u32(13);
            b.put_u8(HEAD);
            b.put_u32(1000);
            b.put_slice(b"short");
            b.freeze()
        }),
        ("a method path that is not a path", {
            let mut h = BytesMut::new();
            h.put_u16(9);
            h.put_slice(b"no\x7fpath!");
            headers(&mut h, 0, &[]);
            packet(17, Some(h.freeze()), None, None, END)
        }),
    ] {
        let c = raw().await;
        c.send(p).await.unwrap();
        let why = closed(&c).await;
        assert!(!why.is_empty(), "{what}: closed without a reason");
        eprintln!("{what}: {why}");
        honest.served(what).await;
        cases += 1;
    }

    // A client that connects and never sends a thing holds one idle connection, no more.
    let mut idle = Vec::new();
    for _ in 0..200 {
        idle.push(raw().await);
    }
    honest.served("200 idle connections").await;
    drop(idle);
    cases += 1;

    let n = honest.finish().await;
    eprintln!("{listen_uri}: {cases} hostile gRPC cases, {n} honest calls verified");
    let _ = stop_tx.send(());
    let _ = tokio::time::timeout(WITHIN, server).await;
    assert_eq!(hostile_util::panics(), 0, "something panicked (see above)");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_bad_packets_cost_only_their_sender_over_tcp() {
    suite("tcp://127.0.0.1:0").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn grpc_bad_packets_cost_only_their_sender_over_shm() {
    suite(&shm_uri()).await;
}

/// Many calls whose handlers never read, each filling its own window: the server holds at
/// most its connection window (`initial_connection_window_size`) plus what the transport
/// has in flight for that client, not calls x window, and other clients go on.
async fn held_bodies_are_bounded_per_connection(listen_uri: &str) {
    hostile_util::count_panics();
    const WINDOW: u32 = 32 << 20;
    const BUDGET: usize = 16 << 20;
    let cfg = ibex_transport::Config {
        rndv_recv_budget: BUDGET,
        ..ibex_config()
    };
    let builder = ibex_transport::grpc::Server::builder()
        .initial_connection_window_size(WINDOW)
        .add_service(BenchImpl::new().0.server(Some(64 << 20), None));
    let stats = builder.stats();
    let (uri, stop_tx, server) = serve(listen_uri, cfg, builder).await;
    let honest = Honest::start(&uri).await;
    honest.served("warming up").await;

    let c = ibex_transport::connect(&uri, ibex_config()).await.unwrap();
    let hold: &[(&str, &[u8])] = &[("content-type", b"application/grpc"), ("x-mode", b"hold")];
    let body = grpc_message(6 << 20);
    let calls = 40u32;
    let sender = {
        let c = c.clone();
        let body = body.clone();
        tokio::spawn(async move {
            for id in 0..calls {
                let head = packet(
                    1 + 2 * id,
                    Some(head_block("Upload", 2, hold)),
                    None,
                    Some(body.len() as u64),
                    0,
                );
                if c.send_parts(head, body.clone()).await.is_err() {
                    return;
                }
            }
        })
    };
    // Let the server take what it will; the sender stalls once it stops reading.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    honest.served("a client held 40 calls' bodies").await;
    // The holding client's connection: the one whose messages are its 6 MiB bodies (the
    // honest client's many small calls can add up to more bytes on a fast machine).
    let taken: u64 = stats
        .connections()
        .iter()
        .max_by_key(|(_, s)| s.proto.rndv_bytes_recv / s.proto.rndv_msgs_recv.max(1))
        .map_or(0, |(_, s)| {
            s.proto.rndv_bytes_recv + s.proto.eager_bytes_recv
        });
    let bound = u64::from(WINDOW) + BUDGET as u64 + 3 * body.len() as u64;
    eprintln!(
        "{listen_uri}: a client offered {} MiB in {calls} held calls; the server took {} MiB (bound {} MiB)",
        (u64::from(calls) * body.len() as u64) >> 20,
        taken >> 20,
        bound >> 20
    );
    assert!(
        taken <= bound,
        "the server took {taken} bytes, over {bound}"
    );
    sender.abort();
    drop(c);
    honest.served("the holding client left").await;
    honest.finish().await;
    // The held calls never end on their own (their handlers wait for ever, and a paused
    // connection reads no reset, as a window-blocked HTTP/2 stream would not): a graceful
    // shutdown would wait on them, so stop the server outright.
    drop(stop_tx);
    server.abort();
    assert_eq!(hostile_util::panics(), 0, "something panicked (see above)");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_bodies_are_bounded_per_connection_over_tcp() {
    held_bodies_are_bounded_per_connection("tcp://127.0.0.1:0").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn held_bodies_are_bounded_per_connection_over_shm() {
    held_bodies_are_bounded_per_connection(&shm_uri()).await;
}

/// A client that sends many calls before it reads any answer: the server's answers pile up
/// past the transport's send queue (answers that find the queue full wait in the call's
/// own future instead of going out in place), and every call still gets its answer, once.
async fn answers_wait_for_a_client_that_reads_late(listen_uri: &str) {
    hostile_util::count_panics();
    let builder = ibex_transport::grpc::Server::builder()
        .add_service(BenchImpl::new().0.server(Some(64 << 20), None));
    let (uri, stop_tx, server) = serve(listen_uri, ibex_config(), builder).await;
    let c = ibex_transport::connect(&uri, ibex_config()).await.unwrap();
    let msg = grpc_message(16);
    let calls: Vec<u32> = (0..1000u32).map(|i| 1 + 2 * i).collect();
    for &id in &calls {
        let p = packet(id, Some(head_block("Echo", 2, GRPC)), Some(&msg), None, END);
        tokio::time::timeout(WITHIN, c.send(p))
            .await
            .expect("the server stopped taking calls")
            .expect("send");
    }
    // Let the server answer all it can before anything is read.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let got = statuses_of(&c, &calls).await.expect("the connection ended");
    assert!(got.iter().all(|s| s == "0"), "statuses: {got:?}");
    drop(c);
    drop(stop_tx);
    server.await.unwrap().unwrap();
    assert_eq!(hostile_util::panics(), 0, "something panicked (see above)");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_wait_for_a_client_that_reads_late_over_tcp() {
    answers_wait_for_a_client_that_reads_late("tcp://127.0.0.1:0").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_wait_for_a_client_that_reads_late_over_shm() {
    answers_wait_for_a_client_that_reads_late(&shm_uri()).await;
}

/// An answer head as the wire format defines it: the HTTP status, then the header list.
fn answer_head(list: &[(&str, &[u8])]) -> Bytes {
    let mut b = BytesMut::new();
    b.put_u16(200);
    headers(&mut b, list.len() as u16, list);
    b.freeze()
}

/// A whole answer of a direct unary call: its head, its message and a lone
/// `grpc-status: 0` trailer, the packet whose head the client keeps once it repeats.
fn whole_answer(call: u32, head: &Bytes, msg: &[u8]) -> Bytes {
    let mut b = BytesMut::from(&packet(call, Some(head.clone()), Some(msg), None, END)[..]);
    let mut t = BytesMut::new();
    headers(&mut t, 1, &[("grpc-status", b"0")]);
    b.put_u32(t.len() as u32);
    b.put_slice(&t);
    b[4] |= TRAILERS;
    b.freeze()
}

/// A scripted server answers the client's direct unary calls with the same head each
/// time, which the client keeps and does not decode again, and mixes in what an honest
/// server would not send: a repeat for a call that is not open, and a head that comes
/// apart from its answer before the same head repeats with the rest. Every call gets its
/// own message, and the connection goes on.
async fn repeats_from_a_scripted_server(listen_uri: &str) {
    hostile_util::count_panics();
    let listener = ibex_transport::listen(listen_uri, ibex_config())
        .await
        .expect("listen");
    let uri = listener.local_uri();
    let server = tokio::spawn(async move {
        let conn = listener.accept().await.expect("accept");
        let head = answer_head(&[("content-type", b"application/grpc"), ("x-kept", b"1")]);
        for n in 0..8usize {
            let req = conn.recv().await.expect("a request");
            let call = u32::from_be_bytes([req[0], req[1], req[2], req[3]]);
            assert_eq!(call % 2, 1, "a direct unary call has an odd id");
            let msg = grpc_message(10 + n);
            match n {
                // A repeat for a call not open (the next id, not made yet), then the
                // answer for the one that is.
                4 => {
                    conn.send(whole_answer(call + 200, &head, &grpc_message(1)))
                        .await
                        .unwrap();
                    conn.send(whole_answer(call, &head, &msg)).await.unwrap();
                }
                // The head alone, then the kept head again with the message: the head
                // went to the caller already, so the rest goes to its body.
                6 => {
                    conn.send(packet(call, Some(head.clone()), None, None, 0))
                        .await
                        .unwrap();
                    conn.send(whole_answer(call, &head, &msg)).await.unwrap();
                }
                _ => conn.send(whole_answer(call, &head, &msg)).await.unwrap(),
            }
        }
        conn
    });
    let ch = ibex_transport::grpc::Channel::connect_with_config(&uri, ibex_config())
        .await
        .expect("connect");
    let mut c = BenchClient::new(ch);
    for n in 0..8usize {
        let r = tokio::time::timeout(
            WITHIN,
            c.echo(Payload {
                buffers: vec![pattern(n, 1)],
            }),
        )
        .await
        .unwrap_or_else(|_| panic!("call {n} hung"))
        .unwrap_or_else(|s| panic!("call {n}: {s:?}"));
        assert_eq!(r.metadata().get("x-kept").unwrap(), "1", "call {n}");
        assert_eq!(
            r.into_inner().buffers,
            vec![pattern(10 + n, 3)],
            "call {n} got its own message"
        );
    }
    let conn = server.await.expect("the scripted server");
    assert!(!conn.is_closed(), "the connection goes on");
    assert_eq!(hostile_util::panics(), 0, "something panicked (see above)");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scripted_servers_repeats_reach_their_calls_over_tcp() {
    repeats_from_a_scripted_server("tcp://127.0.0.1:0").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scripted_servers_repeats_reach_their_calls_over_shm() {
    repeats_from_a_scripted_server(&shm_uri()).await;
}

/// A server whose answer's gRPC prefix announces 4 GiB, sends a little of it and then
/// nothing more: the direct client refuses the message as soon as the prefix is in, as
/// tonic does, instead of buffering and waiting for the rest.
async fn huge_prefix_from_a_scripted_server(listen_uri: &str) {
    let listener = ibex_transport::listen(listen_uri, ibex_config())
        .await
        .expect("listen");
    let uri = listener.local_uri();
    let server = tokio::spawn(async move {
        let conn = listener.accept().await.expect("accept");
        let req = conn.recv().await.expect("a request");
        let call = u32::from_be_bytes([req[0], req[1], req[2], req[3]]);
        let head = answer_head(&[("content-type", b"application/grpc")]);
        let mut frame = vec![0u8, 0xff, 0xff, 0xff, 0xff];
        frame.extend_from_slice(&[7; 1024]);
        conn.send(packet(call, Some(head), Some(&frame), None, 0))
            .await
            .unwrap();
        // The rest never comes; the connection stays open.
        conn
    });
    let ch = ibex_transport::grpc::Channel::connect_with_config(&uri, ibex_config())
        .await
        .expect("connect");
    let mut c = BenchClient::new(ch);
    let e = tokio::time::timeout(
        WITHIN,
        c.echo(Payload {
            buffers: vec![pattern(8, 1)],
        }),
    )
    .await
    .expect("the client waited for a message over its limit")
    .expect_err("a 4 GiB message was accepted");
    assert_eq!(e.code(), tonic::Code::OutOfRange, "{e:?}");
    assert!(e.message().contains("found 4294967295 bytes"), "{e:?}");
    drop(server.await.expect("the scripted server"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_huge_prefix_is_refused_at_once_over_shm() {
    huge_prefix_from_a_scripted_server(&shm_uri()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_huge_prefix_is_refused_at_once_over_tcp() {
    huge_prefix_from_a_scripted_server("tcp://127.0.0.1:0").await;
}

/// What the server holds for one call in flight besides its body bytes (its budget's
/// estimate; see `grpc/server.rs`).
const CALL_COST: usize = 16 << 10;

/// A client that piles up whole calls and never reads an answer: the answers wait in their
/// calls up to the connection's limit, each call past it is refused, and a refusal that finds
/// no send room stops the server reading that connection. So what the server holds stays
/// bounded, no task is spawned per refusal, and the honest client is answered within a
/// second throughout.
async fn a_client_that_never_reads(listen_uri: &str) {
    hostile_util::count_panics();
    let builder = ibex_transport::grpc::Server::builder()
        .max_concurrent_calls(MAX_CALLS)
        .add_service(BenchImpl::new().0.server(Some(64 << 20), None));
    let stats = builder.stats();
    let (uri, stop_tx, server) = serve(listen_uri, ibex_config(), builder).await;
    let honest = Honest::start(&uri).await;
    honest.served("warming up").await;
    let metrics = tokio::runtime::Handle::current().metrics();
    let tasks_before = metrics.num_alive_tasks();

    let c = ibex_transport::connect(&uri, ibex_config()).await.unwrap();
    let sent = Arc::new(AtomicU64::new(0));
    let flood = {
        let (c, sent) = (c.clone(), sent.clone());
        let msg = grpc_message(16);
        tokio::spawn(async move {
            for id in 0u32.. {
                let p = packet(
                    1 + 2 * id,
                    Some(head_block("Echo", 2, GRPC)),
                    Some(&msg),
                    None,
                    END,
                );
                if c.send(p).await.is_err() {
                    return;
                }
                sent.fetch_add(1, Ordering::Relaxed);
            }
        })
    };
    // The flood's calls with their small answers, and the honest client's call in flight.
    let bound = MAX_CALLS * (CALL_COST + 1024) + CALL_COST + (64 << 10);
    let mut most = (0, 0);
    for _ in 0..12 {
        tokio::time::sleep(Duration::from_millis(250)).await;
        honest
            .served_within(
                "a client piled up calls it never reads",
                Duration::from_secs(1),
            )
            .await;
        let held = stats.memory().0;
        let tasks = metrics.num_alive_tasks().saturating_sub(tasks_before);
        most = (most.0.max(held), most.1.max(tasks));
        assert!(held <= bound, "the server holds {held} bytes, over {bound}");
        assert!(
            tasks <= 8,
            "{tasks} more tasks than before: a task per refusal?"
        );
    }
    let sent = sent.load(Ordering::Relaxed);
    eprintln!(
        "{listen_uri}: a client sent {sent} calls and read nothing; the server held at most {} KiB, with {} more tasks",
        most.0 >> 10,
        most.1
    );
    assert!(
        sent > 4 * MAX_CALLS as u64,
        "only {sent} calls went out: the case never reached refusals"
    );
    flood.abort();
    drop(c);
    honest.served("the client that never read left").await;
    honest.finish().await;
    // The flooding client's transport cannot close gracefully (its queued calls never go
    // out to a server that stopped reading it), so a graceful shutdown would wait on it:
    // stop the server outright, which must give back all its calls held.
    drop(stop_tx);
    server.abort();
    let t = Instant::now();
    while stats.memory().0 > 0 {
        assert!(
            t.elapsed() < WITHIN,
            "the stopped server still accounts {} bytes",
            stats.memory().0
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(hostile_util::panics(), 0, "something panicked (see above)");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_never_reads_costs_bounded_memory_over_tcp() {
    a_client_that_never_reads("tcp://127.0.0.1:0").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_never_reads_costs_bounded_memory_over_shm() {
    a_client_that_never_reads(&shm_uri()).await;
}

/// 40 connections open calls with a head and data but no end, to a handler that never
/// reads: the server's memory budget bounds what all of them make it hold together (each
/// connection's own limits would allow far more), the heavy connections stop being read,
/// and the honest client, holding little, is still answered within a second. Everything
/// is given back when they leave.
async fn unended_calls_on_many_connections(listen_uri: &str) {
    hostile_util::count_panics();
    const BUDGET: usize = 64 << 20;
    const CONNS: usize = 40;
    const CALLS: u32 = 500;
    let builder = ibex_transport::grpc::Server::builder()
        .max_memory(BUDGET)
        .add_service(BenchImpl::new().0.server(Some(64 << 20), None));
    let stats = builder.stats();
    let (uri, stop_tx, server) = serve(listen_uri, ibex_config(), builder).await;
    let honest = Honest::start(&uri).await;
    honest.served("warming up").await;

    let hold: &[(&str, &[u8])] = &[("content-type", b"application/grpc"), ("x-mode", b"hold")];
    let msg = grpc_message(8 << 10);
    let mut floods = Vec::new();
    let mut conns = Vec::new();
    for _ in 0..CONNS {
        let c = ibex_transport::connect(&uri, ibex_config()).await.unwrap();
        conns.push(c.clone());
        let msg = msg.clone();
        floods.push(tokio::spawn(async move {
            for id in 0..CALLS {
                let head = Some(head_block("Upload", 2, hold));
                if c.send(packet(1 + 2 * id, head, Some(&msg), None, 0))
                    .await
                    .is_err()
                {
                    return;
                }
            }
        }));
    }
    let offered = CONNS * CALLS as usize * (CALL_COST + msg.len());
    // Each connection may read one message past the floor before it is paused.
    let bound = BUDGET + CONNS * ((1 << 20) + CALL_COST + msg.len());
    let mut most = 0;
    for _ in 0..12 {
        tokio::time::sleep(Duration::from_millis(250)).await;
        honest
            .served_within("40 connections held unended calls", Duration::from_secs(1))
            .await;
        let held = stats.memory().0;
        most = most.max(held);
        assert!(held <= bound, "the server holds {held} bytes, over {bound}");
    }
    eprintln!(
        "{listen_uri}: {CONNS} connections offered {} MiB of unended calls; the server held at most {} MiB (budget {} MiB)",
        offered >> 20,
        most >> 20,
        BUDGET >> 20
    );
    assert!(
        most >= BUDGET,
        "the server held only {most} bytes: the case never reached the budget"
    );
    for f in floods {
        f.abort();
    }
    drop(conns);
    let t = Instant::now();
    while stats.memory().0 > CALL_COST {
        assert!(
            t.elapsed() < WITHIN,
            "the server still holds {} bytes after its clients left",
            stats.memory().0
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    honest.served("the holding clients left").await;
    honest.finish().await;
    drop(stop_tx);
    tokio::time::timeout(WITHIN, server)
        .await
        .expect("the server stops")
        .unwrap()
        .unwrap();
    assert_eq!(hostile_util::panics(), 0, "something panicked (see above)");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unended_calls_on_many_connections_stay_within_the_budget_over_tcp() {
    unended_calls_on_many_connections("tcp://127.0.0.1:0").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unended_calls_on_many_connections_stay_within_the_budget_over_shm() {
    unended_calls_on_many_connections(&shm_uri()).await;
}

/// A scripted server feeds 8 concurrent direct unary calls a 6 MiB answer each, piece by
/// piece, all at once: the channel's window (16 MiB here) bounds what the client holds over
/// all its calls, so calls past it fail `RESOURCE_EXHAUSTED` naming the setting instead of
/// the client holding 8 x 6 MiB, and the calls that complete get their whole message.
async fn many_large_answers_at_once(listen_uri: &str) {
    hostile_util::count_panics();
    const CALLS: usize = 8;
    const PIECE: usize = 1 << 20;
    let listener = ibex_transport::listen(listen_uri, ibex_config())
        .await
        .expect("listen");
    let uri = listener.local_uri();
    let msg = grpc_message(6 << 20);
    let server = {
        let msg = msg.clone();
        tokio::spawn(async move {
            let conn = listener.accept().await.expect("accept");
            let mut calls = Vec::new();
            while calls.len() < CALLS {
                let req = conn.recv().await.expect("a request");
                calls.push(u32::from_be_bytes([req[0], req[1], req[2], req[3]]));
            }
            let head = answer_head(&[("content-type", b"application/grpc")]);
            // Every call's first piece, then every call's second, ...: all calls fill at once.
            for (k, piece) in msg.chunks(PIECE).enumerate() {
                for &call in &calls {
                    let head = (k == 0).then(|| head.clone());
                    if conn
                        .send(packet(call, head, Some(piece), None, 0))
                        .await
                        .is_err()
                    {
                        return conn;
                    }
                }
            }
            for &call in &calls {
                let mut t = BytesMut::new();
                headers(&mut t, 1, &[("grpc-status", b"0")]);
                let mut p = BytesMut::from(&packet(call, None, None, None, END)[..]);
                p.put_u32(t.len() as u32);
                p.put_slice(&t);
                p[4] |= TRAILERS;
                if conn.send(p.freeze()).await.is_err() {
                    break;
                }
            }
            conn
        })
    };
    let cfg = ibex_transport::Config {
        rndv_recv_budget: 16 << 20,
        ..ibex_config()
    };
    let ch = ibex_transport::grpc::Channel::connect_with_config(&uri, cfg)
        .await
        .expect("connect");
    let c = BenchClient::new(ch).max_decoding_message_size(64 << 20);
    let calls = (0..CALLS).map(|_| {
        let mut c = c.clone();
        async move {
            c.echo(Payload {
                buffers: vec![pattern(8, 1)],
            })
            .await
        }
    });
    let results = tokio::time::timeout(WITHIN, futures_util::future::join_all(calls))
        .await
        .expect("the calls hung");
    let mut refused = 0;
    for r in results {
        match r {
            Ok(r) => assert_eq!(
                r.into_inner().buffers,
                vec![pattern(6 << 20, 3)],
                "a call that completes gets its whole message"
            ),
            Err(s) => {
                assert_eq!(s.code(), tonic::Code::ResourceExhausted, "{s:?}");
                assert!(s.message().contains("rndv_recv_budget"), "{s:?}");
                refused += 1;
            }
        }
    }
    eprintln!("{listen_uri}: {refused} of {CALLS} calls of 6 MiB each went past a 16 MiB window");
    assert!(refused >= CALLS - 3, "only {refused} calls were refused");
    drop(server);
    assert_eq!(hostile_util::panics(), 0, "something panicked (see above)");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_channel_window_bounds_many_large_answers_over_tcp() {
    many_large_answers_at_once("tcp://127.0.0.1:0").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_channel_window_bounds_many_large_answers_over_shm() {
    many_large_answers_at_once(&shm_uri()).await;
}
