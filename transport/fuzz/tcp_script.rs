//! A scripted hostile peer against one tcp link, shared by the `tcp_records` fuzz target
//! and `tests/tcp_fuzz_corpus.rs` (which replays the seeds and runs seeded scripts on
//! stable).
//!
//! The input is a script. Each step's first byte (modulo [`step::COUNT`]) picks what the
//! raw peer does (push a region, send garbage, answer a read request, ask for a region,
//! send a frame) or what the link's owner does (post reads of a region or with descriptor
//! bytes of any kind, expose a body, send a frame, poll). Then the peer hangs up and the link
//! is polled until it reports its end. What must hold, whatever the peer sends:
//! - no panic, no hang, nothing allocated by a length the peer chose past the link's caps;
//! - every read `post_read` accepted completes exactly once, and no other id completes;
//!   `reads_outstanding` counts exactly the reads not completed yet;
//! - a read that succeeds holds the region's bytes, as long as the peer sent only
//!   well-formed records with the right bytes (pushes and answers carry `pattern`);
//! - frames arrive whole and in order;
//! - what the link writes is well formed: known records, its pushes in rising region order
//!   and byte for byte the bodies it exposed, its answers in request order with the
//!   exposed bytes.

use std::collections::{HashMap, HashSet, VecDeque};
use std::future::poll_fn;
use std::task::Poll;
use std::time::Duration;

use bytes::{Buf, Bytes, BytesMut};
use ibex_transport::Config;
use ibex_transport::link::{Link, LinkEvent, PushStats};
use ibex_transport::preface::{FEATURE_TCP_PUSH, FIXED_LEN, Preface, Provider};
use ibex_transport::tcp::wire::{HELD_ENTRY_COST, MAX_HELD, MAX_PUSH};
use ibex_transport::tcp::{self, TcpLink};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// The steps a script is made of: a step's first byte, modulo [`step::COUNT`].
#[allow(dead_code)] // The fuzz target only runs scripts; tests write them.
pub mod step {
    /// The owner posts reads of a region, as fragments that tile it or one range of it.
    pub const POST_REGION: u8 = 0;
    /// The peer pushes a region.
    pub const PUSH: u8 = 1;
    /// The peer writes bytes the script does not shape.
    pub const GARBAGE: u8 = 2;
    /// The peer answers the oldest read request the link sent it.
    pub const ANSWER: u8 = 3;
    /// The owner polls the link until nothing more comes.
    pub const PUMP: u8 = 4;
    /// The owner exposes a body, for pushing or for reads only.
    pub const EXPOSE: u8 = 5;
    /// The peer asks for a range of an exposed region (or of one that is not).
    pub const PEER_ASK: u8 = 6;
    /// The peer sends a frame.
    pub const FRAME: u8 = 7;
    /// The owner posts a read with descriptor bytes and a range from the script.
    pub const POST_RAW: u8 = 8;
    /// The owner sends a frame; bodies exposed for pushing go behind it.
    pub const OWNER_FRAME: u8 = 9;
    pub const COUNT: u8 = 10;
    /// `POST_REGION` or `PUSH` followed by a byte of 240 or more, such as this one: the
    /// region id follows as a u64.
    pub const EXPLICIT: u8 = 250;
}

/// Steps a script may take; the rest of a longer input is ignored.
const MAX_STEPS: usize = 48;
/// Bytes the peer pushes or answers in one script, so one input stays quick.
const MAX_PEER_BYTES: usize = 24 << 20;
/// Bytes of read buffers one script may lend the link.
const MAX_READ_BYTES: usize = 24 << 20;
/// Turns of the runtime without an event after which `pump` calls the link idle.
const PUMP_TURNS: u32 = 3;
/// How long the owner waits for room in the link's queue before it looks again.
const PUMP_WAIT: Duration = Duration::from_millis(1);
/// A script that has not finished by then hangs: that is a bug.
const GUARD: Duration = Duration::from_secs(8);

/// Region sizes, picked by region id so that the owner's posts and the peer's pushes
/// agree unless a step says otherwise. The last one is the largest push.
const SIZES: [usize; 8] = [1, 100, 4096, 65_536, 300_001, 1 << 20, 777, MAX_PUSH];

fn size_of(region: u64) -> usize {
    SIZES[(region % SIZES.len() as u64) as usize]
}

/// Regions' bytes start this far apart in [`pattern`]'s table.
const REGION_SHIFT: usize = 4099;
/// Regions whose bytes differ; ids past it repeat.
const REGIONS: u64 = 251;

/// The bytes of `region` at `offset`: what the peer pushes and answers. A slice of one
/// table made once, so a fuzz run spends its time in the link rather than making bytes.
fn pattern(region: u64, offset: usize, len: usize) -> &'static [u8] {
    static TABLE: std::sync::OnceLock<Vec<u8>> = std::sync::OnceLock::new();
    let table = TABLE.get_or_init(|| {
        // Every range a script can name: offsets under 1 MiB, lengths up to 2 x MAX_PUSH.
        (0..REGIONS as usize * REGION_SHIFT + 3 * MAX_PUSH + (1 << 20))
            .map(|i| (i as u8) ^ ((i >> 8) as u8).rotate_left(3) ^ ((i >> 16) as u8))
            .collect()
    });
    let at = (region % REGIONS) as usize * REGION_SHIFT + offset;
    table
        .get(at..at + len)
        .expect("scripts name only ranges the pattern table covers")
}

/// Reads the script; past its end every byte is 0.
struct Script<'a> {
    data: &'a [u8],
}

impl Script<'_> {
    fn u8(&mut self) -> u8 {
        match self.data.split_first() {
            Some((&b, rest)) => {
                self.data = rest;
                b
            }
            None => 0,
        }
    }
    fn u16(&mut self) -> u16 {
        u16::from_le_bytes([self.u8(), self.u8()])
    }
    fn u64(&mut self) -> u64 {
        let mut b = [0u8; 8];
        b.iter_mut().for_each(|x| *x = self.u8());
        u64::from_le_bytes(b)
    }
    fn bytes(&mut self, n: usize) -> Vec<u8> {
        let n = n.min(self.data.len());
        let (head, rest) = self.data.split_at(n);
        self.data = rest;
        head.to_vec()
    }
    fn done(&self) -> bool {
        self.data.is_empty()
    }
}

/// A read the owner lent the link a buffer for.
struct Posted {
    buf: Box<[u8]>,
    region: u64,
    offset: usize,
}

/// A read request the link sent the peer.
struct Ask {
    id: u64,
    region: u64,
    offset: u64,
    len: u32,
}

struct State {
    link: TcpLink,
    raw: TcpStream,
    /// What the link wrote to the peer, not parsed yet.
    inbuf: BytesMut,
    asks: VecDeque<Ask>,
    /// The peer's own read requests: (id, region, offset, len), in order.
    peer_reads: VecDeque<(u64, u64, u64, u32)>,
    /// The peer's last pushed region (pushes must rise).
    peer_pushed: u64,
    /// The peer sent bytes the script did not shape: content checks are off.
    garbage: bool,
    /// Bytes the peer pushed or answered.
    peer_bytes: usize,
    frames_sent: VecDeque<Vec<u8>>,
    /// Frames the owner sent the peer, not seen by it yet.
    owner_frames: VecDeque<Vec<u8>>,
    /// What the owner exposed: region id -> (bytes, pushed).
    exposed: HashMap<u64, (Bytes, bool)>,
    /// The last region the link pushed to the peer.
    link_pushed: u64,
    posted: HashMap<u64, Posted>,
    read_bytes: usize,
    completed: HashSet<u64>,
    next_id: u64,
    link_failed: bool,
    /// The script is over and the peer has hung up.
    hung_up: bool,
    out: Outcome,
}

fn config() -> Config {
    Config {
        slot_size: 4096,
        ..Config::default()
    }
}

/// The preface of a raw client that takes pushes.
fn raw_preface() -> Vec<u8> {
    Preface {
        slot_size: 4096,
        features: FEATURE_TCP_PUSH,
        token: Vec::new(),
        ext: Vec::new(),
    }
    .encode(Provider::Tcp)
}

/// What a script did, for tests that check a script took the path it was written for.
#[derive(Debug, Default)]
#[allow(dead_code)] // The fuzz target only runs scripts.
pub struct Outcome {
    /// The link's own count of pushes, both ways.
    pub pushes: PushStats,
    /// Pushes the link still held when the peer hung up.
    pub held_at_end: usize,
    /// Reads that completed with the region's bytes, and reads that failed before the
    /// peer hung up.
    pub reads_ok: usize,
    pub reads_failed: usize,
    /// Reads `post_read` refused at once (they owe nothing).
    pub posts_refused: usize,
    pub frames: usize,
    /// Read requests, read responses and pushes the link wrote to the peer.
    pub peer_got: [usize; 3],
    /// Why the link failed before the peer hung up, if it did.
    pub error: Option<String>,
}

/// Runs one script. Panics on any broken rule above.
pub fn run(data: &[u8]) -> Outcome {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("a tokio runtime");
    rt.block_on(async {
        tokio::time::timeout(GUARD, run_inner(data))
            .await
            .expect("the script hung: the link neither finished nor failed")
    })
}

async fn run_inner(data: &[u8]) -> Outcome {
    let l = tcp::listen("127.0.0.1:0", &config()).await.expect("listen");
    let mut raw = TcpStream::connect(l.local_addr().expect("local addr"))
        .await
        .expect("connect");
    // Small records must not wait for the peer's ACK of a large one (Nagle).
    raw.set_nodelay(true).expect("nodelay");
    raw.write_all(&raw_preface()).await.expect("preface");
    let link = l.accept().await.expect("accept");
    let mut theirs = [0u8; FIXED_LEN];
    raw.read_exact(&mut theirs)
        .await
        .expect("the link's preface");
    let mut st = State {
        link,
        raw,
        inbuf: BytesMut::new(),
        asks: VecDeque::new(),
        peer_reads: VecDeque::new(),
        peer_pushed: 0,
        garbage: false,
        peer_bytes: 0,
        frames_sent: VecDeque::new(),
        owner_frames: VecDeque::new(),
        exposed: HashMap::new(),
        link_pushed: 0,
        posted: HashMap::new(),
        read_bytes: 0,
        completed: HashSet::new(),
        next_id: 1,
        link_failed: false,
        hung_up: false,
        out: Outcome::default(),
    };
    let mut s = Script { data };
    for _ in 0..MAX_STEPS {
        if s.done() {
            break;
        }
        st.step(&mut s).await;
    }
    // The peer hangs up: the link must fail every read still owed, then itself.
    st.out.pushes = st.link.push_stats();
    st.out.held_at_end = st.link.pushes_held();
    st.hung_up = true;
    let _ = st.raw.shutdown().await;
    while !st.link_failed {
        let ev = poll_fn(|cx| st.link.poll_event(cx)).await;
        st.on_event(ev);
        st.drain_peer();
    }
    // Once failed, it keeps saying so.
    let again = poll_fn(|cx| st.link.poll_event(cx)).await;
    assert!(again.is_err(), "a failed link delivered {again:?}");
    let owed: Vec<u64> = st.posted.keys().copied().collect();
    assert!(owed.is_empty(), "reads never completed: {owed:?}");
    assert_eq!(st.link.reads_outstanding(), 0);
    st.out
}

impl State {
    async fn step(&mut self, s: &mut Script<'_>) {
        match s.u8() % step::COUNT {
            step::POST_REGION => self.post_region(s),
            step::PUSH => self.push(s).await,
            step::GARBAGE => {
                let n = s.u8() as usize;
                let b = s.bytes(n);
                self.garbage = true;
                self.peer_write(&b).await;
            }
            step::ANSWER => self.answer(s).await,
            step::PUMP => self.pump().await,
            step::EXPOSE => self.expose(s),
            step::PEER_ASK => self.peer_ask(s).await,
            step::FRAME => {
                let n = 1 + s.u16() as usize % 5000;
                let body: Vec<u8> = (0..n).map(|i| i as u8 ^ 0x5a).collect();
                let mut rec = record(0, n);
                rec.extend_from_slice(&body);
                self.frames_sent.push_back(body);
                self.peer_write(&rec).await;
            }
            step::POST_RAW => self.post_raw(s),
            _ => self.send_frame(s).await,
        }
    }

    /// The owner sends a frame (an RTS, say): the bodies it exposed for pushing go behind it.
    async fn send_frame(&mut self, s: &mut Script<'_>) {
        let n = 1 + s.u16() as usize % 4096;
        let body: Vec<u8> = (0..n).map(|i| i as u8 ^ 0xa5).collect();
        let State {
            link, raw, inbuf, ..
        } = self;
        let sent = loop {
            let r = poll_fn(|cx| match link.poll_send(cx, &body) {
                Poll::Ready(r) => Poll::Ready(Some(r)),
                Poll::Pending => Poll::Ready(None),
            })
            .await;
            match r {
                Some(r) => break r.is_ok(),
                // The link's queue is full: the peer reads what came, the runtime looks at
                // the sockets (the link may wait only for its own to be writable), and the
                // link tries again.
                None => {
                    let _ = tokio::time::timeout(PUMP_WAIT, raw.readable()).await;
                    read_raw(raw, inbuf);
                }
            }
        };
        if sent {
            self.owner_frames.push_back(body);
        }
        // Writes what fits now; the rest goes with later polls.
        let _ = poll_fn(|cx| Poll::Ready(self.link.poll_flush(cx).is_ready())).await;
        self.drain_peer();
    }

    /// The owner posts reads of a region the peer pushes (or not), as fragments that tile
    /// it, or one range of it.
    fn post_region(&mut self, s: &mut Script<'_>) {
        let b = s.u8();
        let region = if b >= 240 {
            s.u64() & !(1 << 63)
        } else {
            self.peer_pushed + 1 + u64::from(b % 3)
        };
        let k = s.u8();
        let pushed = k & 0x80 == 0;
        let len = size_of(region);
        let ranges: Vec<(usize, usize)> = if k & 0x40 == 0 {
            let parts = 1 + (k as usize & 3).min(len - 1);
            let step = len / parts;
            (0..parts)
                .map(|i| {
                    let at = i * step;
                    let end = if i + 1 == parts { len } else { at + step };
                    (at, end - at)
                })
                .collect()
        } else {
            let at = s.u16() as usize % len;
            let n = 1 + s.u16() as usize % (len - at);
            vec![(at, n)]
        };
        for (at, n) in ranges {
            self.post(region, len as u64, pushed, at as u64, n);
        }
    }

    /// Posts one read; the link may refuse it, and then owes nothing.
    fn post(&mut self, region: u64, region_len: u64, pushed: bool, offset: u64, len: usize) {
        let mut d = (region | if pushed { 1 << 63 } else { 0 })
            .to_le_bytes()
            .to_vec();
        d.extend_from_slice(&region_len.to_le_bytes());
        self.post_desc(&d, region, offset, len);
    }

    fn post_desc(&mut self, d: &[u8], region: u64, offset: u64, len: usize) {
        if self.read_bytes + len > MAX_READ_BYTES {
            return;
        }
        let id = self.next_id;
        self.next_id += 1;
        let mut buf = vec![0u8; len].into_boxed_slice();
        // SAFETY: `buf` lives in `self.posted` until the read's `ReadDone`, and the script
        // ends only once the link has failed every read it still owed.
        let r = unsafe { self.link.post_read(id, d, offset, buf.as_mut_ptr(), len) };
        if r.is_err() {
            self.out.posts_refused += 1;
        } else {
            self.read_bytes += len;
            self.posted.insert(
                id,
                Posted {
                    buf,
                    region,
                    offset: offset as usize,
                },
            );
        }
    }

    /// The owner posts a read with descriptor bytes and a range from the script.
    fn post_raw(&mut self, s: &mut Script<'_>) {
        let n = match s.u8() % 4 {
            0 => s.u8() as usize % 40,
            _ => 16,
        };
        let d = s.bytes(n);
        let offset = u64::from(s.u16()) * 16;
        let len = s.u16() as usize * 32;
        let region = if d.len() >= 8 {
            u64::from_le_bytes(d[..8].try_into().unwrap_or([0; 8])) & !(1 << 63)
        } else {
            0
        };
        self.post_desc(&d, region, offset, len);
    }

    /// The peer pushes a region: usually the next ones, at their size; sometimes out of
    /// order, at another size, or with a record that lies about its length.
    async fn push(&mut self, s: &mut Script<'_>) {
        let b = s.u8();
        let region = match b {
            0..=199 => self.peer_pushed + 1 + u64::from(b % 3),
            200..=239 => self.peer_pushed.saturating_sub(u64::from(b % 3)),
            _ => s.u64(),
        };
        let how = s.u8();
        let len = match how % 8 {
            0 => s.u16() as usize % (MAX_PUSH + 2),
            _ => size_of(region),
        };
        if self.peer_bytes + len > MAX_PEER_BYTES {
            return;
        }
        self.peer_bytes += len;
        let claimed = if how & 0x80 != 0 && how & 0x40 != 0 {
            len as u32 ^ 1
        } else {
            len as u32
        };
        if region > self.peer_pushed {
            self.peer_pushed = region.min(1 << 62);
        }
        let mut rec = record(3, 12 + len);
        rec.extend_from_slice(&region.to_le_bytes());
        rec.extend_from_slice(&claimed.to_le_bytes());
        self.peer_write(&rec).await;
        self.peer_write(pattern(region, 0, len)).await;
    }

    /// The peer answers the oldest read request the link sent it: with the region's bytes,
    /// a refusal, or a response that breaks the rules.
    async fn answer(&mut self, s: &mut Script<'_>) {
        self.drain_peer();
        let Some(ask) = self.asks.pop_front() else {
            return;
        };
        let how = s.u8();
        let mut rec;
        match how % 8 {
            0 => {
                let text = b"no such region";
                rec = record(2, 13 + text.len());
                rec.extend_from_slice(&ask.id.to_le_bytes());
                rec.push(1);
                rec.extend_from_slice(&(text.len() as u32).to_le_bytes());
                rec.extend_from_slice(text);
            }
            1 => {
                // Wrong id, or a length other than asked.
                let (id, len) = if how & 0x80 != 0 {
                    (ask.id + 1, ask.len)
                } else {
                    (ask.id, ask.len.saturating_sub(1))
                };
                rec = record(2, 13 + len as usize);
                rec.extend_from_slice(&id.to_le_bytes());
                rec.push(0);
                rec.extend_from_slice(&len.to_le_bytes());
                rec.extend_from_slice(pattern(ask.region, ask.offset as usize, len as usize));
                self.garbage = true;
            }
            _ => {
                let len = ask.len as usize;
                if self.peer_bytes + len > MAX_PEER_BYTES {
                    self.asks.push_front(ask);
                    return;
                }
                self.peer_bytes += len;
                rec = record(2, 13 + len);
                rec.extend_from_slice(&ask.id.to_le_bytes());
                rec.push(0);
                rec.extend_from_slice(&ask.len.to_le_bytes());
                self.peer_write(&rec).await;
                self.peer_write(pattern(ask.region, ask.offset as usize, len))
                    .await;
                return;
            }
        }
        self.peer_write(&rec).await;
    }

    /// The owner exposes a body: as a message body, pushed towards this peer (it takes
    /// pushes) where the core's rule says so (`LinkCaps::pushes`), as a connection would;
    /// or for reads only.
    fn expose(&mut self, s: &mut Script<'_>) {
        let b = s.u8();
        let len = SIZES[(b % 8) as usize] + usize::from(b & 0x40 != 0) * (MAX_PUSH - 7);
        let data = Bytes::from_static(pattern(u64::from(b) + 1000, 0, len));
        let message = b & 0x80 == 0;
        let r = if message && self.link.info().caps().pushes(len) {
            self.link.expose_pushed(data.clone())
        } else {
            self.link.expose(data.clone())
        };
        if let Ok(exp) = r {
            self.exposed.insert(exp.id, (data, message));
        }
    }

    /// The peer asks for a range of an exposed region (or of one that is not).
    async fn peer_ask(&mut self, s: &mut Script<'_>) {
        let b = s.u8();
        let mut ids: Vec<u64> = self.exposed.keys().copied().collect();
        ids.sort_unstable();
        let region = match ids.get(b as usize % (ids.len() + 1)) {
            Some(&id) if b < 250 => id,
            _ => s.u64(),
        };
        let (offset, len) = match self.exposed.get(&region) {
            Some((data, _)) if b & 1 == 0 => (0, data.len() as u32),
            _ => (u64::from(s.u16()), u32::from(s.u16())),
        };
        let id = 1 + self.peer_reads.back().map_or(0, |r| r.0);
        let mut rec = record(1, 28);
        rec.extend_from_slice(&id.to_le_bytes());
        rec.extend_from_slice(&region.to_le_bytes());
        rec.extend_from_slice(&offset.to_le_bytes());
        rec.extend_from_slice(&len.to_le_bytes());
        self.peer_reads.push_back((id, region, offset, len));
        self.peer_write(&rec).await;
    }

    /// Writes `bytes` as the peer, polling the link meanwhile (so that a large record
    /// cannot wedge both sides), and reading what it writes back.
    async fn peer_write(&mut self, bytes: &[u8]) {
        let mut at = 0;
        // A failed link reads no more: what is left would never go.
        while at < bytes.len() && !self.link_failed {
            self.drain_peer();
            match self.raw.try_write(&bytes[at..]) {
                Ok(n) => at += n,
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    let State { link, raw, .. } = self;
                    let ev = tokio::select! {
                        ev = poll_fn(|cx| link.poll_event(cx)) => Some(ev),
                        _ = raw.writable() => None,
                    };
                    if let Some(ev) = ev {
                        self.on_event(ev);
                    }
                }
                // The link closed its end: it failed, and says so on the next poll.
                Err(_) => return,
            }
        }
    }

    /// Polls the link until nothing more comes. The peer's bytes are on loopback, in the
    /// link's socket by the time the peer's write returns, so a few turns of the runtime
    /// (each looks at the sockets) without an event mean there is none to come.
    async fn pump(&mut self) {
        let mut idle = 0;
        while idle < PUMP_TURNS && !self.link_failed {
            self.drain_peer();
            let ev = poll_fn(|cx| match self.link.poll_event(cx) {
                Poll::Ready(ev) => Poll::Ready(Some(ev)),
                Poll::Pending => Poll::Ready(None),
            })
            .await;
            match ev {
                Some(ev) => {
                    idle = 0;
                    self.on_event(ev);
                }
                None => {
                    idle += 1;
                    tokio::task::yield_now().await;
                }
            }
        }
        self.drain_peer();
    }

    fn on_event(&mut self, ev: Result<LinkEvent, ibex_transport::Error>) {
        match ev {
            Err(e) => {
                if !self.link_failed && !self.hung_up {
                    self.out.error = Some(e.to_string());
                }
                self.link_failed = true;
            }
            Ok(LinkEvent::Frame(f)) => {
                self.out.frames += 1;
                let want = self.frames_sent.pop_front().filter(|_| !self.garbage);
                if let Some(want) = want {
                    assert_eq!(&f[..], &want[..], "a frame arrived changed or out of order");
                }
            }
            Ok(LinkEvent::ReadDone { id, result }) => {
                assert!(
                    self.completed.insert(id),
                    "read {id} completed twice, or was never posted"
                );
                let p = self
                    .posted
                    .remove(&id)
                    .unwrap_or_else(|| panic!("read {id} completed but was never posted"));
                self.read_bytes -= p.buf.len();
                match (&result, self.hung_up) {
                    (Ok(()), _) => self.out.reads_ok += 1,
                    (Err(_), false) => self.out.reads_failed += 1,
                    (Err(_), true) => {}
                }
                if result.is_ok() && !self.garbage {
                    assert!(
                        p.buf[..] == *pattern(p.region, p.offset, p.buf.len()),
                        "read {id} of region {} at {} succeeded with the wrong bytes",
                        p.region,
                        p.offset
                    );
                }
            }
        }
        if !self.link_failed {
            assert_eq!(
                self.link.reads_outstanding(),
                self.posted.len(),
                "reads_outstanding disagrees with the reads owed"
            );
        }
        assert!(
            self.link.pushes_held() <= MAX_HELD / HELD_ENTRY_COST,
            "the link holds {} pushes",
            self.link.pushes_held()
        );
    }

    /// Reads and checks what the link wrote to the peer.
    fn drain_peer(&mut self) {
        read_raw(&self.raw, &mut self.inbuf);
        while self.inbuf.len() >= 5 {
            let kind = self.inbuf[0];
            let len = u32::from_le_bytes(self.inbuf[1..5].try_into().unwrap_or([0; 4])) as usize;
            if self.inbuf.len() < 5 + len {
                break;
            }
            self.inbuf.advance(5);
            let body = self.inbuf.split_to(len).freeze();
            self.on_link_record(kind, body);
        }
    }

    fn on_link_record(&mut self, kind: u8, body: Bytes) {
        let u64_at = |at: usize| u64::from_le_bytes(body[at..at + 8].try_into().unwrap_or([0; 8]));
        let u32_at = |at: usize| u32::from_le_bytes(body[at..at + 4].try_into().unwrap_or([0; 4]));
        match kind {
            0 => {
                let want = self
                    .owner_frames
                    .pop_front()
                    .expect("the link wrote a frame its owner never sent");
                assert!(
                    body[..] == want[..],
                    "the link wrote a frame changed or out of order"
                );
            }
            1 => {
                assert_eq!(
                    body.len(),
                    28,
                    "the link wrote a read request of {} bytes",
                    body.len()
                );
                self.out.peer_got[0] += 1;
                self.asks.push_back(Ask {
                    id: u64_at(0),
                    region: u64_at(8),
                    offset: u64_at(16),
                    len: u32_at(24),
                });
            }
            2 => {
                assert!(body.len() >= 13, "the link wrote a short read response");
                let (id, status, len) = (u64_at(0), body[8], u32_at(9) as usize);
                assert_eq!(
                    body.len(),
                    13 + len,
                    "the link's response lies about its length"
                );
                let (want, region, offset, asked) = self
                    .peer_reads
                    .pop_front()
                    .expect("the link answered a read nobody asked for");
                assert_eq!(id, want, "the link answered out of request order");
                self.out.peer_got[1] += 1;
                if status == 0 {
                    let (data, _) = self
                        .exposed
                        .get(&region)
                        .expect("the link served a region it never exposed");
                    assert_eq!(len, asked as usize);
                    let at = offset as usize;
                    assert!(
                        body[13..] == data[at..at + len],
                        "the link served wrong bytes"
                    );
                } else {
                    assert!(len <= 4096, "the link's error text is too long");
                }
            }
            3 => {
                assert!(body.len() >= 12, "the link wrote a short push");
                let (region, len) = (u64_at(0), u32_at(8) as usize);
                assert_eq!(
                    body.len(),
                    12 + len,
                    "the link's push lies about its length"
                );
                assert!(region > self.link_pushed, "the link pushed out of order");
                self.link_pushed = region;
                self.out.peer_got[2] += 1;
                let (data, message) = self
                    .exposed
                    .get(&region)
                    .expect("the link pushed a region it never exposed");
                assert!(*message, "the link pushed a region exposed for reads only");
                assert!(body[12..] == data[..], "the link pushed wrong bytes");
            }
            other => panic!("the link wrote record type {other}"),
        }
    }
}

/// Reads what the link wrote and the peer's socket holds now.
fn read_raw(raw: &TcpStream, inbuf: &mut BytesMut) {
    let mut chunk = [0u8; 64 << 10];
    while let Ok(n @ 1..) = raw.try_read(&mut chunk) {
        inbuf.extend_from_slice(&chunk[..n]);
    }
}

/// A record header of `kind` for a body of `len` bytes.
fn record(kind: u8, len: usize) -> Vec<u8> {
    let mut r = vec![kind];
    r.extend_from_slice(&(len as u32).to_le_bytes());
    r
}
