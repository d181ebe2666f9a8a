//! The hostile-peer suite, shared by one test binary per provider (`hostile_tcp.rs`,
//! `hostile_shm.rs`, `hostile_verbs.rs`): a scripted peer that completes the provider's
//! honest set-up and then speaks the frame format by hand, an echo server, and an honest
//! client that keeps exchanging verified messages with the same listener the whole time.
//!
//! Every case asserts that the bad peer is closed (a `Close` frame naming the problem, or
//! the link ending) rather than left silent; the run asserts that the honest client lost
//! or corrupted nothing and kept being served while each bad peer was connected, that
//! nothing panicked anywhere in the process, and that memory stayed bounded.

#![allow(dead_code)] // each provider's binary uses the cases that apply to it

use std::future::poll_fn;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use bytes::{Bytes, BytesMut};
use ibex_transport::conn::Addr;
use ibex_transport::link::{Link, LinkEvent};
use ibex_transport::proto::frame::{Body, Frame, HelloExt};
use ibex_transport::{Config, Connection, Listener, connect, listen};

#[path = "../conn_util/mod.rs"]
mod conn_util;
pub use conn_util::{fixed_threshold, pattern, uri};

/// How long a bad peer may wait for its close. A hang guard, not a performance assertion;
/// Soft-RoCE under emulation (the VM sets `RXE_VM`) is 10-100x slower than hardware.
fn close_within() -> Duration {
    if std::env::var("RXE_VM").is_ok() {
        Duration::from_secs(90)
    } else {
        Duration::from_secs(20)
    }
}

/// Largest message the server accepts: the honest client stays under it, hostile
/// announcements go over it.
pub const MAX_MESSAGE: u64 = 4 << 20;

static PANICS: AtomicUsize = AtomicUsize::new(0);

/// Counts every panic in the process (a spawned task's panic never reaches the test
/// otherwise), keeping the default report.
pub fn count_panics() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let prev = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            PANICS.fetch_add(1, Ordering::SeqCst);
            prev(info);
        }));
    });
}

/// Panics seen so far in this process.
pub fn panics() -> usize {
    PANICS.load(Ordering::SeqCst)
}

/// Resident memory of this process, in bytes.
pub fn rss() -> u64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: u64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|p| p.parse().ok())
        .unwrap_or(0);
    pages * 4096
}

/// The server's configuration: a set-up deadline that every honest set-up of the suite
/// (over a thousand, on a loaded machine too) beats by far, and a small message limit, so
/// oversize announcements are cheap to make.
pub fn server_config(provider: &str) -> Config {
    Config {
        handshake_timeout: Duration::from_secs(20),
        max_message_size: MAX_MESSAGE,
        rndv_recv_budget: 8 << 20,
        rdma_device: device(provider, "IBEX_TEST_SERVER_DEV"),
        pool_size: pool_size(provider),
        ..fixed_threshold(16 << 10)
    }
}

/// The set-up deadline of the listener that closes a silent peer: short, so the wait stays
/// within the test (verbs set-up under emulation takes seconds, so longer there).
pub fn silence_deadline(provider: &str) -> Duration {
    Duration::from_secs(if provider == "verbs" { 20 } else { 2 })
}

/// Verbs pins each connection's pool: a 2 GiB test VM holds a few dozen of 8 MiB, not of
/// the default 256 MiB.
fn pool_size(provider: &str) -> usize {
    if provider == "verbs" {
        8 << 20
    } else {
        Config::default().pool_size
    }
}

/// A client's configuration (on two-device topologies the client has its own device).
pub fn client_config(provider: &str) -> Config {
    Config {
        rdma_device: device(provider, "IBEX_TEST_CLIENT_DEV"),
        pool_size: pool_size(provider),
        ..fixed_threshold(16 << 10)
    }
}

fn device(provider: &str, var: &str) -> Option<String> {
    (provider == "verbs")
        .then(|| std::env::var(var).ok())
        .flatten()
}

/// A listener whose every connection echoes each message back until it ends.
pub struct Server {
    pub uri: String,
    pub provider: String,
    _listener: Arc<Listener>,
    /// Connections that ended with an error (a bad peer's, as a rule).
    pub errors: Arc<AtomicU64>,
}

impl Server {
    pub async fn start(provider: &str, tag: &str) -> Server {
        Server::start_with(provider, tag, true, server_config(provider)).await
    }

    /// A server whose application never reads: no credit ever goes back to a peer, so a
    /// window overrun is one, whatever the timing.
    pub async fn deaf(provider: &str, tag: &str) -> Server {
        Server::start_with(provider, tag, false, server_config(provider)).await
    }

    /// A server with the short set-up deadline of [`silence_deadline`].
    pub async fn impatient(provider: &str, tag: &str) -> Server {
        let config = Config {
            handshake_timeout: silence_deadline(provider),
            ..server_config(provider)
        };
        Server::start_with(provider, tag, true, config).await
    }

    async fn start_with(provider: &str, tag: &str, reads: bool, config: Config) -> Server {
        let l = Arc::new(listen(&uri(provider, tag), config).await.expect("listen"));
        let errors = Arc::new(AtomicU64::new(0));
        let (lc, ec) = (l.clone(), errors.clone());
        tokio::spawn(async move {
            while let Ok(c) = lc.accept().await {
                let ec = ec.clone();
                tokio::spawn(async move {
                    if !reads {
                        // Held, never read, until the peer goes.
                        while !c.is_closed() {
                            tokio::time::sleep(Duration::from_millis(20)).await;
                        }
                        return;
                    }
                    loop {
                        match c.recv().await {
                            Ok(m) => {
                                if c.send(m).await.is_err() {
                                    ec.fetch_add(1, Ordering::Relaxed);
                                    return;
                                }
                            }
                            Err(_) => {
                                ec.fetch_add(1, Ordering::Relaxed);
                                return;
                            }
                        }
                    }
                });
            }
        });
        Server {
            uri: l.local_uri(),
            provider: provider.to_owned(),
            _listener: l,
            errors,
        }
    }
}

/// An honest client exchanging verified messages of eager and rendezvous sizes with the
/// server until stopped. `done` counts verified round trips.
pub struct Honest {
    pub done: Arc<AtomicU64>,
    stop: Arc<AtomicBool>,
    /// Why the client stopped, once it has: the assertion that finds it stopped says so.
    failed: Arc<std::sync::Mutex<Option<String>>>,
    task: tokio::task::JoinHandle<Result<u64, String>>,
}

impl Honest {
    pub async fn start(server: &Server) -> Honest {
        let c: Connection = connect(&server.uri, client_config(&server.provider))
            .await
            .expect("the honest client connects");
        let done = Arc::new(AtomicU64::new(0));
        let stop = Arc::new(AtomicBool::new(false));
        let (d, s) = (done.clone(), stop.clone());
        let failed = Arc::new(std::sync::Mutex::new(None));
        let f = failed.clone();
        let task = tokio::spawn(async move {
            let r = Self::echo_loop(c, d, s).await;
            if let Err(e) = &r {
                *f.lock().unwrap() = Some(e.clone());
            }
            r
        });
        Honest {
            done,
            stop,
            failed,
            task,
        }
    }

    async fn echo_loop(
        c: Connection,
        d: Arc<AtomicU64>,
        s: Arc<AtomicBool>,
    ) -> Result<u64, String> {
        {
            let sizes = [64usize, 4 << 10, 300 << 10, 1 << 20];
            let mut i = 0u64;
            while !s.load(Ordering::Relaxed) {
                let want = pattern(sizes[i as usize % sizes.len()], i as u8);
                c.send(want.clone())
                    .await
                    .map_err(|e| format!("send {i}: {e}"))?;
                let got = tokio::time::timeout(Duration::from_secs(30), c.recv())
                    .await
                    .map_err(|_| {
                        format!(
                            "echo {i} not answered within 30 s; the client's stats: {:?}",
                            c.stats()
                        )
                    })?
                    .map_err(|e| format!("echo {i}: {e}"))?;
                if got != want {
                    return Err(format!("echo {i} came back different"));
                }
                i += 1;
                d.store(i, Ordering::Relaxed);
            }
            Ok(i)
        }
    }

    /// Waits until the client has completed `n` more round trips: proof that it is being
    /// served now.
    pub async fn served(&self, n: u64, while_: &str) {
        let from = self.done.load(Ordering::Relaxed);
        let t = Instant::now();
        while self.done.load(Ordering::Relaxed) < from + n {
            assert!(
                !self.task.is_finished(),
                "the honest client stopped while {while_}: {:?}",
                self.failed.lock().unwrap()
            );
            assert!(
                t.elapsed() < Duration::from_secs(30),
                "the honest client was not served for 30 s while {while_}"
            );
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
    }

    pub async fn finish(self) -> u64 {
        self.stop.store(true, Ordering::Relaxed);
        match self.task.await {
            Ok(Ok(n)) => n,
            Ok(Err(e)) => panic!("the honest client failed: {e}"),
            Err(e) => panic!("the honest client's task died: {e}"),
        }
    }
}

/// How a bad peer's connection ended.
#[derive(Debug)]
pub enum Outcome {
    /// The server sent `Close`.
    Closed { code: u32, reason: String },
    /// The link ended without a `Close` (the server dropped it, or the provider saw it go).
    Ended(String),
}

/// A peer that set its link up honestly (preface, token, provider resources) and then
/// sends whatever its script says.
pub struct Peer {
    link: Box<dyn Link>,
    /// The server's `Hello`, once seen.
    pub server_slots: Option<u32>,
    /// Reads this peer posted that finished, with their results.
    pub reads: Vec<(u64, Result<(), String>)>,
}

impl Peer {
    pub async fn connect(server: &Server) -> Peer {
        Peer::connect_uri(&server.uri).await
    }

    pub async fn connect_uri(uri: &str) -> Peer {
        let addr = Addr::parse(uri).expect("server uri");
        let provider = match &addr {
            Addr::Shm(_) => "shm",
            Addr::Tcp(_) => "tcp",
            Addr::Verbs(_) => "verbs",
            Addr::Auto(_) => panic!("hostile peers speak one provider: give a concrete address"),
        };
        let config = client_config(provider);
        let link: Box<dyn Link> = match addr {
            Addr::Shm(p) => Box::new(
                ibex_transport::shm::connect(&p, &config)
                    .await
                    .expect("shm set-up"),
            ),
            Addr::Tcp(a) => Box::new(
                ibex_transport::tcp::connect(&a, &config)
                    .await
                    .expect("tcp set-up"),
            ),
            #[cfg(feature = "verbs")]
            Addr::Verbs(a) => Box::new(
                ibex_transport::verbs::connect(&a, &config)
                    .await
                    .expect("verbs set-up"),
            ),
            #[cfg(not(feature = "verbs"))]
            Addr::Verbs(_) => panic!("verbs needs the `verbs` feature"),
            Addr::Auto(_) => unreachable!("refused above"),
        };
        Peer {
            link,
            server_slots: None,
            reads: Vec::new(),
        }
    }

    pub fn link(&mut self) -> &mut dyn Link {
        &mut *self.link
    }

    /// Sends one frame's bytes as they are. `Err` if our own link refused them.
    pub async fn send_raw(&mut self, frame: &[u8]) -> Result<(), String> {
        poll_fn(|cx| self.link.poll_send(cx, frame))
            .await
            .map_err(|e| e.to_string())?;
        poll_fn(|cx| self.link.poll_flush(cx))
            .await
            .map_err(|e| e.to_string())
    }

    pub async fn send(&mut self, f: &Frame) -> Result<(), String> {
        self.send_raw(&f.to_bytes()).await
    }

    /// Our `Hello`, as an honest peer would send it.
    pub async fn hello(&mut self) {
        self.send(&hello()).await.expect("send Hello");
    }

    /// Sends `Hello` and waits for the server's, which says how many frames it takes.
    pub async fn handshake(&mut self) -> u32 {
        self.hello().await;
        let t = Instant::now();
        while self.server_slots.is_none() {
            assert!(t.elapsed() < close_within(), "the server sent no Hello");
            match tokio::time::timeout(close_within(), self.event()).await {
                Ok(Ok(_)) => {}
                Ok(Err(e)) => panic!("the server closed an honest handshake: {e}"),
                Err(_) => panic!("the server sent no Hello"),
            }
        }
        self.server_slots.unwrap_or(0)
    }

    /// The next frame the server sent (decoded), or why the link ended. Read completions
    /// are recorded in `reads` and reported as `None`.
    async fn event(&mut self) -> Result<Option<Body>, String> {
        match poll_fn(|cx| self.link.poll_event(cx)).await {
            Ok(LinkEvent::Frame(b)) => {
                let f = Frame::decode(&b).map_err(|e| format!("undecodable frame: {e}"))?;
                if let Body::Hello { slots, .. } = f.body {
                    self.server_slots = Some(slots);
                }
                Ok(Some(f.body))
            }
            Ok(LinkEvent::ReadDone { id, result }) => {
                self.reads.push((id, result.map_err(|e| e.to_string())));
                Ok(None)
            }
            Err(e) => Err(e.to_string()),
        }
    }

    /// Reads until the server closes this peer; fails the test if it stays silent.
    pub async fn outcome(&mut self, what: &str) -> Outcome {
        let end = async {
            loop {
                match self.event().await {
                    Ok(Some(Body::Close { code, reason })) => {
                        return Outcome::Closed { code, reason };
                    }
                    Ok(_) => {}
                    Err(e) => return Outcome::Ended(e),
                }
            }
        };
        match tokio::time::timeout(close_within(), end).await {
            Ok(o) => o,
            Err(_) => panic!(
                "{what}: the server left the bad peer hanging for {:?} instead of closing it",
                close_within()
            ),
        }
    }
}

pub fn hello() -> Frame {
    Frame::new(Body::Hello {
        slots: 64,
        slot_size: 64 << 10,
        max_message: 1 << 30,
        fragment_size: 1 << 20,
        ext: HelloExt::default().encode(),
    })
}

pub fn bytes_of(f: &Frame) -> BytesMut {
    let mut b = BytesMut::new();
    f.encode(&mut b);
    b
}

fn eager(payload: &'static [u8]) -> Frame {
    Frame::new(Body::Eager {
        msgs: vec![Bytes::from_static(payload)],
    })
}

fn rts(seq: u64, len: u64, desc: Bytes) -> Frame {
    Frame::new(Body::Rts {
        seq,
        len,
        desc,
        head: Bytes::new(),
    })
}

/// What a case expects of the server.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Expect {
    /// A protocol-violation `Close` (code 1) whose reason contains this text.
    Violation(&'static str),
    /// Closed, by a `Close` of any code or the link ending.
    Closed,
}

/// One scripted bad peer: what it does after its honest set-up.
pub struct Case {
    pub name: String,
    /// Run against the server that never reads (see [`Server::deaf`]).
    pub deaf: bool,
    pub hello_first: bool,
    pub frames: Vec<Bytes>,
    pub expect: Expect,
}

fn case(name: impl Into<String>, hello_first: bool, frames: Vec<Bytes>, expect: Expect) -> Case {
    Case {
        name: name.into(),
        deaf: false,
        hello_first,
        frames,
        expect,
    }
}

/// Frame `f` with one header byte changed.
fn patched(f: &Frame, at: usize, value: u8) -> Bytes {
    let mut b = bytes_of(f);
    b[at] = value;
    b.freeze()
}

/// Every frame-level case that needs no provider resource: bad headers, bad bodies,
/// truncation at every byte, oversize lengths and counts, protocol-order violations and a
/// credit-window overrun (`slots` is the server's window, from a first handshake).
pub fn frame_cases(slots: u32, every_byte: bool) -> Vec<Case> {
    let h = hello();
    let msg = eager(b"hello");
    let an_rts = rts(0, 1 << 20, Bytes::from_static(&[1, 2, 3, 4, 5, 6, 7, 8]));
    let mut v = vec![
        case(
            "a data frame before Hello",
            false,
            vec![msg.to_bytes()],
            Expect::Violation("before the peer's Hello"),
        ),
        case(
            "bad magic",
            false,
            vec![patched(&h, 0, 0x00)],
            Expect::Violation("bad magic"),
        ),
        case(
            "a wrong wire version",
            false,
            vec![patched(&h, 1, 99)],
            Expect::Violation("wire version"),
        ),
        case(
            "an unknown frame kind",
            true,
            vec![patched(&msg, 2, 77)],
            Expect::Violation("unknown frame kind"),
        ),
        case(
            "unknown flag bits",
            true,
            vec![patched(&msg, 3, 0x80)],
            Expect::Violation("undefined flag"),
        ),
        case(
            "a body length past the frame",
            true,
            vec![patched(&msg, 11, 0x7f)],
            Expect::Violation("header says the body"),
        ),
        case(
            "a Hello announcing 0 slots",
            false,
            vec![
                Frame::new(Body::Hello {
                    slots: 0,
                    slot_size: 64 << 10,
                    max_message: 1 << 30,
                    fragment_size: 1 << 20,
                    ext: Bytes::new(),
                })
                .to_bytes(),
            ],
            Expect::Violation("slots"),
        ),
        case(
            "a Hello announcing 16-byte slots",
            false,
            vec![
                Frame::new(Body::Hello {
                    slots: 64,
                    slot_size: 16,
                    max_message: 1 << 30,
                    fragment_size: 1 << 20,
                    ext: Bytes::new(),
                })
                .to_bytes(),
            ],
            Expect::Violation("slots"),
        ),
        case(
            "a second Hello",
            true,
            vec![h.to_bytes()],
            Expect::Violation("second Hello"),
        ),
        case(
            "credits for frames never sent",
            true,
            vec![
                Frame {
                    credits: 1000,
                    body: Body::Credit,
                }
                .to_bytes(),
            ],
            Expect::Violation("credits"),
        ),
        case(
            "an eager count of 65535 carrying one message",
            true,
            vec![{
                let mut b = bytes_of(&msg);
                b[12] = 0xff;
                b[13] = 0xff;
                b.freeze()
            }],
            Expect::Violation("malformed frame"),
        ),
        case(
            "an eager message length of 4 GiB",
            true,
            vec![{
                let mut b = bytes_of(&msg);
                b[14..18].copy_from_slice(&u32::MAX.to_le_bytes());
                b.freeze()
            }],
            Expect::Violation("malformed frame"),
        ),
        case(
            "an RTS announcing 1 TiB",
            true,
            vec![rts(0, 1 << 40, Bytes::from_static(&[0; 8])).to_bytes()],
            Expect::Violation("max_message_size"),
        ),
        case(
            "an RTS out of sequence",
            true,
            vec![rts(5, 100, Bytes::from_static(&[0; 8])).to_bytes()],
            Expect::Violation("where message 0 was expected"),
        ),
        case(
            "a descriptor of 300 bytes",
            true,
            vec![{
                let mut b = bytes_of(&an_rts);
                let at = 12 + 16;
                b[at..at + 2].copy_from_slice(&300u16.to_le_bytes());
                b.freeze()
            }],
            Expect::Violation("descriptor"),
        ),
        case(
            "RndvDone for a message never sent",
            true,
            vec![
                Frame::new(Body::RndvDone {
                    seq: 7,
                    probe: false,
                })
                .to_bytes(),
            ],
            Expect::Violation("not an outstanding rendezvous"),
        ),
        case(
            "a probe answer for no probe",
            true,
            vec![Frame::new(Body::ProbeAck { probe_id: 4242 }).to_bytes()],
            Expect::Closed,
        ),
        case(
            "a probe read of 1 TiB",
            true,
            vec![
                Frame::new(Body::ProbeRts {
                    probe_id: 1,
                    len: 1 << 40,
                    desc: Bytes::from_static(&[0; 8]),
                })
                .to_bytes(),
            ],
            Expect::Closed,
        ),
        case(
            "an empty frame",
            true,
            vec![Bytes::new()],
            Expect::Violation("shorter than"),
        ),
    ];
    // A window overrun: one data frame more than the server granted, sent at once.
    let mut overrun = case(
        format!("{} data frames into a window of {slots}", slots + 1),
        true,
        (0..=slots).map(|_| msg.to_bytes()).collect(),
        Expect::Violation("no credit left"),
    );
    overrun.deaf = true;
    v.push(overrun);
    // Truncation at every byte of a Hello (before the handshake) and of an RTS and an
    // eager frame (after it).
    for (what, f, hello_first) in [
        ("Hello", &h, false),
        ("RTS", &an_rts, true),
        ("eager frame", &msg, true),
    ] {
        let full = f.to_bytes();
        // Where each set-up is slow (verbs under emulation), the field boundaries only.
        let cuts: Vec<usize> = if every_byte {
            (1..full.len()).collect()
        } else {
            [1, 4, 8, 11, 12, 13, 20, full.len() - 1]
                .into_iter()
                .filter(|&c| c < full.len())
                .collect()
        };
        for cut in cuts {
            v.push(case(
                format!("a {what} cut to {cut} of {} bytes", full.len()),
                hello_first,
                vec![full.slice(..cut)],
                Expect::Closed,
            ));
        }
    }
    v
}

/// Runs one case on a fresh peer; returns a description of what went wrong, if anything.
pub async fn run_case(server: &Server, c: &Case) -> Result<Outcome, String> {
    let mut p = Peer::connect(server).await;
    if c.hello_first {
        p.handshake().await;
    }
    for f in &c.frames {
        if let Err(e) = p.send_raw(f).await {
            // The server may close before it has read everything we send.
            if matches!(c.expect, Expect::Closed) || !f.is_empty() {
                tracing::debug!(case = %c.name, %e, "send failed, reading the close");
                break;
            }
            return Err(format!("{}: our own link refused the frame: {e}", c.name));
        }
    }
    let o = p.outcome(&c.name).await;
    match (&o, c.expect) {
        (Outcome::Closed { code: 1, reason }, Expect::Violation(text)) if reason.contains(text) => {
            Ok(o)
        }
        (_, Expect::Violation(text)) => Err(format!(
            "{}: expected a protocol-violation close naming {text:?}, got {o:?}",
            c.name
        )),
        (_, Expect::Closed) => Ok(o),
    }
}

/// A peer that sends an RTS for a buffer it never exposed: the server's read of it must
/// fail and cost only this peer.
pub async fn rts_for_memory_never_exposed(server: &Server) -> Outcome {
    let mut p = Peer::connect(server).await;
    p.handshake().await;
    // A descriptor-shaped lie: plausible length, ids and keys that name nothing.
    let desc = Bytes::from(vec![0x5a; 24]);
    p.send(&rts(0, 256 << 10, desc)).await.expect("send RTS");
    p.outcome("an RTS for memory never exposed").await
}

/// A peer that exposes a buffer, announces it, and disconnects before the server read it.
pub async fn disconnect_mid_rendezvous(server: &Server) {
    let mut p = Peer::connect(server).await;
    p.handshake().await;
    let buf = pattern(2 << 20, 9);
    let exp = p.link().expose(buf).expect("expose a buffer");
    p.send(&rts(0, 2 << 20, exp.descriptor.clone()))
        .await
        .expect("send RTS");
    p.link().close();
    drop(p);
}

/// Opens `n` connections that finish their set-up and handshake, then stay idle; returns
/// them so the caller decides how long they stay.
pub async fn idle_peers(server: &Server, n: usize) -> Vec<Peer> {
    let mut v = Vec::with_capacity(n);
    for _ in 0..n {
        let mut p = Peer::connect(server).await;
        p.handshake().await;
        v.push(p);
    }
    v
}

/// The whole suite against one provider's listener, with an honest client running
/// throughout. `idle` is how many idle connections to hold at the end; `forged_read`
/// builds a descriptor of the server's that it never gave out (None where the provider
/// cannot tell a forged one: see `docs/security.md`).
pub async fn run_suite(provider: &str, idle: usize, forged_read: Option<Bytes>, every_byte: bool) {
    conn_util::init_tracing();
    count_panics();
    let server = Server::start(provider, "hostile").await;
    let deaf = Server::deaf(provider, "hostile-deaf").await;
    // The silent peer's own listener: the short deadline there would be a race for every
    // honest set-up on the main one.
    let impatient = Server::impatient(provider, "hostile-impatient").await;
    let honest = Honest::start(&server).await;
    honest.served(20, "warming up").await;
    let rss0 = rss();
    let mut peak = rss0;

    let slots = Peer::connect(&server).await.handshake().await;
    let cases = frame_cases(slots, every_byte);
    let mut failures = Vec::new();
    for c in &cases {
        match run_case(if c.deaf { &deaf } else { &server }, c).await {
            Ok(o) => tracing::debug!(case = %c.name, outcome = ?o),
            Err(e) => failures.push(e),
        }
        honest.served(1, &c.name).await;
        peak = peak.max(rss());
    }

    // Silence after set-up: closed at the handshake deadline. The server's clock starts at
    // its accept, before our connect returns, so ours starts before we connect.
    let t = Instant::now();
    let mut silent = Peer::connect(&impatient).await;
    let silent_outcome = silent.outcome("silence after set-up").await;
    let waited = t.elapsed();
    tracing::info!(?silent_outcome, ?waited, "silent peer");
    honest.served(1, "a silent peer waited").await;

    let o = rts_for_memory_never_exposed(&server).await;
    tracing::info!(?o, "RTS for memory never exposed");
    honest.served(1, "an RTS for memory never exposed").await;

    if let Some(desc) = forged_read {
        let mut p = Peer::connect(&server).await;
        p.handshake().await;
        let mut dst = vec![0u8; 4096];
        // SAFETY: `dst` outlives the read: we wait for the read's completion or the end of
        // the link below before dropping it.
        let posted = unsafe { p.link().post_read(1, &desc, 0, dst.as_mut_ptr(), dst.len()) };
        if posted.is_ok() {
            let t = Instant::now();
            while p.reads.is_empty() && t.elapsed() < close_within() {
                match tokio::time::timeout(close_within(), p.event()).await {
                    Ok(Ok(_)) => {}
                    Ok(Err(_)) | Err(_) => break,
                }
            }
            match p.reads.first() {
                Some((_, Ok(()))) => failures
                    .push("a read of a descriptor the server never gave out succeeded".into()),
                Some((_, Err(e))) => tracing::info!(%e, "forged read refused"),
                None => tracing::info!("forged read: the link ended"),
            }
        }
        drop(p);
        drop(dst);
        honest.served(1, "a forged read").await;
    }

    for _ in 0..8 {
        disconnect_mid_rendezvous(&server).await;
    }
    honest.served(5, "peers disconnected mid-rendezvous").await;

    let before_idle = rss();
    let t = Instant::now();
    let idle_peers = idle_peers(&server, idle).await;
    let opened = t.elapsed();
    honest.served(20, "idle connections were held").await;
    let with_idle = rss();
    peak = peak.max(with_idle);
    drop(idle_peers);

    let n = honest.finish().await;
    let cases_run = cases.len() + 4 + usize::from(idle > 0);
    eprintln!(
        "{provider}: {cases_run} hostile cases ({} frame-level), honest round trips {n}, \
         RSS start {} MiB peak {} MiB, {idle} idle connections opened in {opened:?} \
         (+{} MiB for both ends in this process), silent peer closed after {waited:?}",
        cases.len(),
        rss0 >> 20,
        peak >> 20,
        with_idle.saturating_sub(before_idle) >> 20
    );
    assert!(
        failures.is_empty(),
        "{} cases failed:\n{}",
        failures.len(),
        failures.join("\n")
    );
    assert_eq!(panics(), 0, "something panicked (see the output above)");
    assert!(
        matches!(&silent_outcome, Outcome::Closed { reason, .. } if reason.contains("handshake_timeout")),
        "the silent peer was closed without a reason naming the deadline: {silent_outcome:?}"
    );
    assert!(
        waited >= Duration::from_secs(1),
        "the silent peer was closed after {waited:?}, before the {:?} set-up deadline",
        silence_deadline(provider)
    );
    // Bounded, not measured: the frame cases must not grow memory with their count.
    assert!(
        peak.saturating_sub(rss0) < 512 << 20,
        "RSS grew from {} MiB to {} MiB during the hostile cases",
        rss0 >> 20,
        peak >> 20
    );
}
