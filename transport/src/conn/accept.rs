//! The listener's acceptor: one task per listening socket takes raw streams off it and sets
//! each one up (provider preface, then the protocol handshake) in a task of its own, under
//! a deadline and a cap on set-ups in progress. Finished connections wait in a channel for
//! [`super::Listener::accept`], so a peer that stalls or sends junk costs only its own
//! slot, and `accept` only ever waits on a channel (cancel-safe).
//!
//! Set-up slots go by progress: a peer whose whole preface has arrived takes the slot of
//! one still waiting for its preface, so peers that drip their bytes, however often they
//! reconnect, never keep an honest peer out (see [`admit`]). Connections once made count
//! against [`Config::max_connections`] until they close (see [`Conns`]).

use std::collections::{HashSet, VecDeque};
use std::net::IpAddr;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

use tokio::io::Interest;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};
use tokio::task::Id as TaskId;
use tokio::task::{AbortHandle, JoinSet};

use super::Connection;
use crate::config::Config;
use crate::error::{Error, Result};
use crate::link::Link;
use crate::preface::{self, Provider};

/// One listening socket, as the acceptor sees it.
pub(super) enum Source {
    Shm(crate::shm::ShmListener),
    Tcp(crate::tcp::TcpListener),
    #[cfg(feature = "verbs")]
    Verbs(crate::verbs::VerbsListener),
}

/// A stream accepted but not yet set up.
enum Raw {
    Shm(tokio::net::UnixStream),
    Tcp(tokio::net::TcpStream, String),
    #[cfg(feature = "verbs")]
    Verbs(tokio::net::TcpStream, String, crate::verbs::VerbsOptions),
}

impl Source {
    fn provider(&self) -> &'static str {
        match self {
            Source::Shm(_) => "shm",
            Source::Tcp(_) => "tcp",
            #[cfg(feature = "verbs")]
            Source::Verbs(_) => "verbs",
        }
    }

    /// Whether serve threads ([`Config::serve_threads`]) take this source's connections.
    /// shm's receiver finds messages by reading memory, which a serve thread's spin does
    /// itself. A tcp message comes through the kernel, and a one-worker serve thread that
    /// spins looks at its I/O events only between steps, which makes its calls slower.
    /// Verbs completions are read from memory too, but serve threads are untried on a NIC,
    /// so verbs stays on the application's runtime.
    fn homed(&self) -> bool {
        match self {
            Source::Shm(_) => true,
            Source::Tcp(_) => false,
            #[cfg(feature = "verbs")]
            Source::Verbs(_) => false,
        }
    }

    async fn accept(&self) -> Result<Raw> {
        Ok(match self {
            Source::Shm(l) => Raw::Shm(l.accept_stream().await?),
            Source::Tcp(l) => {
                let (s, peer) = l.accept_stream().await?;
                Raw::Tcp(s, peer)
            }
            #[cfg(feature = "verbs")]
            Source::Verbs(l) => {
                let (s, peer) = l.accept_stream().await?;
                Raw::Verbs(s, peer, l.options().clone())
            }
        })
    }
}

/// The longest preface a peer may send: what [`Raw::peek`] looks at.
const PREFACE_MAX: usize = preface::FIXED_LEN + preface::MAX_TOKEN + preface::MAX_EXT;

/// Whether `b`, the start of what a peer sent, lets its set-up run to an end without
/// waiting on the peer: its whole preface, or enough to see it is none (a wrong magic,
/// version or length). Honest peers send their preface in one write, right after
/// connecting.
fn opened(provider: Provider, b: &[u8]) -> bool {
    let Some(fixed) = b.first_chunk::<{ preface::FIXED_LEN }>() else {
        return false;
    };
    match preface::decode_header(provider, fixed, "peer") {
        Ok(h) => b.len() >= preface::FIXED_LEN + h.rest_len(),
        Err(_) => true,
    }
}

/// Looks at what the peer has sent on `fd` without taking it off the socket and without
/// waiting. `Ok(true)`: [`opened`], or the peer has hung up; `Err(WouldBlock)`: not yet.
fn peek_opened(
    fd: std::os::fd::RawFd,
    provider: Provider,
    buf: &mut [u8],
) -> std::io::Result<bool> {
    // SAFETY: `fd` is an open socket its stream owns for the whole call; `buf` is writable
    // for its length.
    let n = unsafe {
        libc::recv(
            fd,
            buf.as_mut_ptr().cast(),
            buf.len(),
            libc::MSG_PEEK | libc::MSG_DONTWAIT,
        )
    };
    match usize::try_from(n) {
        Err(_) => Err(std::io::Error::last_os_error()),
        Ok(0) => Ok(true),
        Ok(n) if opened(provider, &buf[..n]) => Ok(true),
        Ok(_) => Err(std::io::ErrorKind::WouldBlock.into()),
    }
}

impl Raw {
    fn provider(&self) -> Provider {
        match self {
            Raw::Shm(_) => Provider::Shm,
            Raw::Tcp(..) => Provider::Tcp,
            #[cfg(feature = "verbs")]
            Raw::Verbs(..) => Provider::Verbs,
        }
    }

    /// The peer's address, for the bound on set-ups per source; `None` for local peers.
    fn source(&self) -> Option<IpAddr> {
        match self {
            Raw::Shm(_) => None,
            Raw::Tcp(s, _) => s.peer_addr().ok().map(|a| a.ip()),
            #[cfg(feature = "verbs")]
            Raw::Verbs(s, _, _) => s.peer_addr().ok().map(|a| a.ip()),
        }
    }

    fn fd(&self) -> std::os::fd::RawFd {
        use std::os::fd::AsRawFd;
        match self {
            Raw::Shm(s) => s.as_raw_fd(),
            Raw::Tcp(s, _) => s.as_raw_fd(),
            #[cfg(feature = "verbs")]
            Raw::Verbs(s, _, _) => s.as_raw_fd(),
        }
    }

    /// Whether the peer's preface is all there now (see [`opened`]).
    fn opened_now(&self) -> bool {
        let mut buf = [0u8; PREFACE_MAX];
        !matches!(peek_opened(self.fd(), self.provider(), &mut buf), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock)
    }

    /// Waits until the peer's preface is all there (or it hung up, or sent something that
    /// is no preface), leaving every byte on the socket for the provider's set-up. Each
    /// arrival wakes it once; a peer that drips its bytes costs a wake-up per drip.
    async fn await_opened(&self) {
        let mut buf = vec![0u8; PREFACE_MAX];
        let (fd, provider) = (self.fd(), self.provider());
        loop {
            let ready = match self {
                Raw::Shm(s) => s.ready(Interest::READABLE).await,
                Raw::Tcp(s, _) => s.ready(Interest::READABLE).await,
                #[cfg(feature = "verbs")]
                Raw::Verbs(s, _, _) => s.ready(Interest::READABLE).await,
            };
            let Ok(ready) = ready else { return };
            // Through `try_io`, so that a "not yet" clears the readiness it saw, and only
            // that: bytes arriving meanwhile wake the next round.
            let peek = || peek_opened(fd, provider, &mut buf);
            let r = match self {
                Raw::Shm(s) => s.try_io(Interest::READABLE, peek),
                Raw::Tcp(s, _) => s.try_io(Interest::READABLE, peek),
                #[cfg(feature = "verbs")]
                Raw::Verbs(s, _, _) => s.try_io(Interest::READABLE, peek),
            };
            match r {
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                    // The peer hung up part-way: nothing more will come.
                    if ready.is_read_closed() {
                        return;
                    }
                }
                _ => return,
            }
        }
    }

    fn peer(&self) -> String {
        match self {
            Raw::Shm(_) => "a local shm peer".into(),
            Raw::Tcp(_, p) => format!("tcp peer {p}"),
            #[cfg(feature = "verbs")]
            Raw::Verbs(_, p, _) => format!("verbs peer {p}"),
        }
    }

    /// The provider's set-up. `Ok(None)`: the peer hung up before its first byte (such as
    /// another listener's liveness check of an shm path), which is no failure.
    async fn setup(self, config: &Config) -> Result<Option<Box<dyn Link>>> {
        Ok(match self {
            Raw::Shm(s) => crate::shm::accept_setup(s, config)
                .await?
                .map(|l| Box::new(l) as Box<dyn Link>),
            Raw::Tcp(s, peer) => Some(Box::new(
                crate::tcp::setup(s, config, peer, crate::tcp::Role::Server).await?,
            )),
            #[cfg(feature = "verbs")]
            Raw::Verbs(s, peer, opts) => Some(Box::new(
                crate::verbs::accept_setup(s, config, &opts, peer).await?,
            )),
        })
    }
}

/// What every acceptor task of one listener shares.
pub(super) struct Shared {
    pub config: Config,
    pub slots: Arc<Semaphore>,
    pub ready: mpsc::Sender<Connection>,
    pub warnings: WarnLimit,
    /// The connections made and not yet closed, against [`Config::max_connections`].
    pub conns: std::sync::Mutex<Conns>,
}

/// Warnings about bad peers per second, at most: a flood of them must not become a flood
/// of log lines (disk, and the operator's attention). What is held back is counted in the
/// next warning that goes out.
const WARNINGS_PER_SEC: u32 = 10;

/// Rate limit for the listener's warnings about peers.
#[derive(Default)]
pub(super) struct WarnLimit {
    /// Start of the current one-second window, warnings in it, and those held back.
    state: std::sync::Mutex<Option<(Instant, u32, u64)>>,
}

impl WarnLimit {
    /// `Some(n)` if a warning may go out now, with `n` held back before it.
    fn allow(&self) -> Option<u64> {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let now = Instant::now();
        let (start, sent, held) = st.get_or_insert((now, 0, 0));
        if now.duration_since(*start) >= Duration::from_secs(1) {
            (*start, *sent) = (now, 0);
        }
        if *sent < WARNINGS_PER_SEC {
            *sent += 1;
            Some(std::mem::take(held))
        } else {
            *held += 1;
            None
        }
    }
}

/// Descriptors kept back from [`Config::max_connections`]'s default besides one per set-up
/// slot and lobby place ([`LOBBY_PER_SLOT`]): the process's own files, its runtime, logs
/// and checkpoints.
const FD_RESERVE: usize = 64;

/// [`Config::max_connections`], or what the descriptor limit leaves: `RLIMIT_NOFILE` less
/// the set-ups (each slot and lobby place holds a socket) and [`FD_RESERVE`], and never
/// below half the limit, so a small limit still leaves room to serve.
pub(super) fn max_connections(config: &Config) -> usize {
    if let Some(n) = config.max_connections {
        return n;
    }
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `lim` is a valid out-pointer for the call.
    let soft = if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } == 0 {
        usize::try_from(lim.rlim_cur).unwrap_or(usize::MAX)
    } else {
        1024
    };
    let reserve =
        FD_RESERVE.saturating_add(config.max_handshakes.saturating_mul(1 + LOBBY_PER_SLOT));
    soft.saturating_sub(reserve).max(soft / 2).max(1)
}

/// How long a connection must have carried no message before a newcomer past
/// [`Config::max_connections`] may take its place: long beside the pauses of a busy
/// client, so only connections that sit unused give way.
const MIN_IDLE: Duration = Duration::from_secs(1);

/// How often, at most, the acceptor looks over its connections when it is at the cap:
/// each look locks every connection once, and a flood of newcomers must not turn that
/// into work per newcomer.
const SCAN_EVERY: Duration = Duration::from_millis(10);

/// The connections a listener made that are still open.
#[derive(Default)]
pub(super) struct Conns {
    list: Vec<Tracked>,
    scanned: Option<Instant>,
}

struct Tracked {
    conn: Weak<super::driver::Shared>,
    /// Messages it had carried either way when last looked at, and when that count last
    /// changed (or the connection was made).
    msgs: u64,
    active: Instant,
}

fn messages(st: &super::driver::State) -> u64 {
    let p = st.core.stats();
    p.eager_msgs_recv + p.rndv_msgs_recv + p.eager_msgs_sent + p.rndv_msgs_sent
}

impl Conns {
    fn add(&mut self, conn: &Connection) {
        let shared = conn.shared();
        let msgs = messages(&shared.lock());
        self.list.push(Tracked {
            conn: Arc::downgrade(shared),
            msgs,
            active: Instant::now(),
        });
    }

    /// Whether a newcomer fits under `cap`. At the cap, drops the closed connections from
    /// the count, and if still at it, closes the one idle longest (past [`MIN_IDLE`]) to
    /// make room: `Err` says why the newcomer must go instead. Returns the peer of a
    /// connection closed for it.
    fn make_room(&mut self, cap: usize, now: Instant) -> std::result::Result<Option<String>, ()> {
        if self.list.len() < cap {
            return Ok(None);
        }
        if self
            .scanned
            .is_some_and(|t| now.duration_since(t) < SCAN_EVERY)
        {
            return Err(());
        }
        self.scanned = Some(now);
        let mut idlest: Option<(usize, Instant)> = None;
        let mut i = 0;
        self.list.retain_mut(|t| {
            let Some(c) = t.conn.upgrade() else {
                return false;
            };
            let st = c.lock();
            if st.closed.is_some() {
                return false;
            }
            let msgs = messages(&st);
            if msgs != t.msgs {
                (t.msgs, t.active) = (msgs, now);
            }
            if idlest.is_none_or(|(_, a)| t.active < a) {
                idlest = Some((i, t.active));
            }
            i += 1;
            true
        });
        if self.list.len() < cap {
            return Ok(None);
        }
        match idlest {
            Some((i, active)) if now.duration_since(active) >= MIN_IDLE => {
                let t = self.list.swap_remove(i);
                let Some(c) = t.conn.upgrade() else {
                    return Ok(None);
                };
                let peer = {
                    let mut st = c.lock();
                    st.close_requested = true;
                    if st.close_reason.is_empty() {
                        st.close_reason = "the server is at its cap of connections (Config::max_connections, IBEX_MAX_CONNECTIONS, ibex-ps --max-connections) and closed this one, idle the longest, for a new peer".into();
                    }
                    st.info.peer.clone()
                };
                c.wake_driver();
                Ok(Some(peer))
            }
            _ => Err(()),
        }
    }
}

/// How far a set-up has come.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Stage {
    /// Waiting for the peer's preface.
    Opening,
    /// The preface is all there: the set-up runs without waiting on the peer (but for the
    /// protocol handshake's answers).
    Opened,
    /// Made: the connection waits for `accept`, and only that ends the claim.
    Made,
}

/// One set-up's claim on a slot of `max_handshakes`. The acceptor can take the permit back
/// from a set-up still in progress (and abort it) to make room for a newcomer.
struct Slot {
    permit: Option<OwnedSemaphorePermit>,
    stage: Stage,
    started: Instant,
    peer: String,
    source: Option<IpAddr>,
    abort: Option<AbortHandle>,
}

type SlotRef = Arc<std::sync::Mutex<Slot>>;

fn lock(s: &SlotRef) -> std::sync::MutexGuard<'_, Slot> {
    s.lock().unwrap_or_else(|e| e.into_inner())
}

/// Gives the slot back when its set-up task ends, however it ends.
struct SlotGuard(SlotRef);

impl Drop for SlotGuard {
    fn drop(&mut self) {
        lock(&self.0).permit = None;
    }
}

/// How long a set-up must have waited before a newcomer that has not sent its preface yet
/// may take its slot: honest tcp and shm set-ups finish in milliseconds, so a burst of
/// honest peers never evicts its own, while a flood of silent ones gives way within this.
fn eviction_age(config: &Config) -> Duration {
    (config.handshake_timeout / 10).min(Duration::from_millis(250))
}

/// How long a set-up may wait for its peer's preface before a newcomer whose preface is
/// all there takes its slot. An honest peer writes its preface right after connecting, so
/// it arrives within a network round trip of the accept; a peer still short of it after
/// this is slow or hostile, and gives way to one that is ready.
const OPENING_GRACE: Duration = Duration::from_millis(20);

/// How long a newcomer that found no slot may wait in the lobby for its preface: honest
/// peers that the listener took before their preface arrived have it there by then.
const LOBBY_WAIT: Duration = Duration::from_millis(50);

/// Lobby places per set-up slot. A flood of newcomers pushes the longest-waiting out of a
/// full lobby, so its size decides how long an honest peer's preface may take to arrive
/// under a flood: the places over the flood's rate of connects.
const LOBBY_PER_SLOT: usize = 2;

/// Set-ups waiting for their preface that one source address may hold, as a share of
/// [`Config::max_handshakes`]: a flood from one host keeps most slots free for the others.
fn per_source(config: &Config) -> usize {
    (config.max_handshakes / 4).max(1)
}

/// A set-up in progress as [`admit`] sees it.
#[derive(Debug, Clone, Copy)]
struct View {
    stage: Stage,
    age: Duration,
    source: Option<IpAddr>,
}

/// What becomes of a newcomer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Admit {
    /// A free slot is its.
    Free,
    /// It takes the slot of the set-up at this index.
    Evict(usize),
    /// Nothing can be had now: it waits in the lobby (for its preface, or for a set-up to
    /// fall behind) and tries once more.
    Lobby,
}

/// The set-up policy, in one place. `views` lists the set-ups in progress oldest first;
/// `free` says whether a slot is free; `opened` whether the newcomer's preface is all
/// there.
///
/// - A newcomer whose preface is there takes a free slot, else that of the oldest set-up
///   still waiting for its preface after [`OPENING_GRACE`].
/// - A source holds at most [`per_source`] set-ups that wait for their prefaces: past
///   it, its newcomers with no preface yet can only take the place of its own.
/// - Any newcomer may take the slot of a set-up older than [`eviction_age`] (a peer
///   stalling in the protocol handshake, or one that never sends its preface).
/// - Otherwise it waits in the lobby.
fn admit(
    views: &[View],
    free: bool,
    opened: bool,
    source: Option<IpAddr>,
    per_source: usize,
    eviction_age: Duration,
) -> Admit {
    let stale = |v: &View| v.stage != Stage::Made && v.age >= eviction_age;
    let behind = |v: &View| v.stage == Stage::Opening && v.age >= OPENING_GRACE;
    if !opened && source.is_some() {
        let mine = || {
            views
                .iter()
                .enumerate()
                .filter(|(_, v)| v.stage == Stage::Opening && v.source == source)
        };
        if mine().count() >= per_source {
            return match mine().find(|(_, v)| stale(v)) {
                Some((i, _)) => Admit::Evict(i),
                None => Admit::Lobby,
            };
        }
    }
    if free {
        return Admit::Free;
    }
    let victim = if opened {
        views.iter().position(behind)
    } else {
        None
    };
    match victim.or_else(|| views.iter().position(stale)) {
        Some(i) => Admit::Evict(i),
        None => Admit::Lobby,
    }
}

/// Takes back the slot of `s` and aborts its set-up (its peer's socket closes).
fn evict(s: &SlotRef) -> Option<(OwnedSemaphorePermit, String)> {
    let mut g = lock(s);
    let permit = g.permit.take()?;
    if let Some(a) = g.abort.take() {
        a.abort();
    }
    Some((permit, std::mem::take(&mut g.peer)))
}

/// The acceptor's own state.
struct Acceptor {
    shared: Arc<Shared>,
    homes: usize,
    setups: JoinSet<()>,
    pending: VecDeque<SlotRef>,
    min_age: Duration,
    per_source: usize,
    cap: usize,
    /// Newcomers waiting without a slot, oldest first: their tasks, and whether their
    /// preface is in. An entry whose task is no longer in `lobby_live` has ended and leaves
    /// once it comes to the front.
    lobby: VecDeque<(TaskId, AbortHandle, bool)>,
    /// The lobby's tasks not yet seen to end (the acceptor reaps them from `setups`).
    /// Under a flood every newcomer finds the lobby full, so its fullness is a count kept
    /// as tasks end, not a look over every place.
    lobby_live: HashSet<TaskId>,
    lobby_done: mpsc::Sender<Raw>,
    /// [`admit`]'s view of the set-ups in progress, kept to spare an allocation per
    /// newcomer.
    views: Vec<View>,
}

impl Acceptor {
    fn warn_refused(&self, peer: &str, why: &str) {
        if let Some(held_back) = self.shared.warnings.allow() {
            tracing::warn!(%peer, held_back, "refused a connection: {why}")
        }
    }

    /// Takes in a newcomer: a set-up slot, the lobby, or a close. `retried`: it comes back
    /// from the lobby, and goes now either way.
    fn take(&mut self, raw: Raw, retried: bool) {
        let now = Instant::now();
        let room = self
            .shared
            .conns
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .make_room(self.cap, now);
        match room {
            Ok(None) => {}
            Ok(Some(closed)) => {
                if let Some(held_back) = self.shared.warnings.allow() {
                    tracing::warn!(
                        peer = %closed,
                        held_back,
                        limit = self.cap,
                        "closed the connection idle the longest to make room for a new peer: the listener is at its cap of connections (Config::max_connections, IBEX_MAX_CONNECTIONS, ibex-ps --max-connections)"
                    )
                }
            }
            Err(()) => {
                let why = format!(
                    "{} connections are open and none has been idle for {MIN_IDLE:?} (Config::max_connections, IBEX_MAX_CONNECTIONS, ibex-ps --max-connections; the default follows ulimit -n)",
                    self.cap
                );
                return self.warn_refused(&raw.peer(), &why);
            }
        }
        // Ended claims leave, and what is left is what `admit` sees, in one pass.
        let mut views = std::mem::take(&mut self.views);
        views.clear();
        self.pending.retain(|s| {
            let g = lock(s);
            if g.permit.is_some() {
                views.push(View {
                    stage: g.stage,
                    age: now.saturating_duration_since(g.started),
                    source: g.source,
                });
            }
            g.permit.is_some()
        });
        let opened = retried || raw.opened_now();
        let source = raw.source();
        let free = self.shared.slots.clone().try_acquire_owned().ok();
        let max = self.shared.config.max_handshakes;
        let decision = admit(
            &views,
            free.is_some(),
            opened,
            source,
            self.per_source,
            self.min_age,
        );
        self.views = views;
        let permit = match decision {
            Admit::Free => free,
            Admit::Evict(i) => {
                drop(free);
                let taken = self.pending.get(i).and_then(evict);
                if let Some((_, evicted)) = &taken
                    && let Some(held_back) = self.shared.warnings.allow()
                {
                    tracing::warn!(
                        peer = %evicted,
                        limit = max,
                        held_back,
                        "closed a connection set-up that was not getting on to make room for a new peer: {max} set-ups were in progress (Config::max_handshakes, IBEX_MAX_HANDSHAKES)"
                    )
                }
                // That set-up may have ended meanwhile, giving its slot back.
                taken
                    .map(|(p, _)| p)
                    .or_else(|| self.shared.slots.clone().try_acquire_owned().ok())
            }
            Admit::Lobby if !retried => {
                drop(free);
                return self.send_to_lobby(raw, opened);
            }
            Admit::Lobby => {
                let why = format!(
                    "{max} set-ups are already in progress, all of them getting on (Config::max_handshakes, IBEX_MAX_HANDSHAKES)"
                );
                return self.warn_refused(&raw.peer(), &why);
            }
        };
        let Some(permit) = permit else {
            return self.warn_refused(&raw.peer(), "no set-up slot could be had");
        };
        let slot = Arc::new(std::sync::Mutex::new(Slot {
            permit: Some(permit),
            stage: if opened {
                Stage::Opened
            } else {
                Stage::Opening
            },
            started: now,
            peer: raw.peer(),
            source,
            abort: None,
        }));
        let fut = set_up(raw, self.shared.clone(), SlotGuard(slot.clone()));
        // Set up on its home, so the link's wake-ups register with the runtime that will
        // run the connection.
        let abort = match super::home::next(self.homes) {
            Some(h) => self
                .setups
                .spawn_on(super::home::set_up_on(h.clone(), fut), &h),
            None => self.setups.spawn(fut),
        };
        lock(&slot).abort = Some(abort);
        self.pending.push_back(slot);
    }

    /// Lets a newcomer with no slot wait, holding only its socket, and then takes it in
    /// once more: one with no preface yet until its preface is there (at most
    /// [`LOBBY_WAIT`]), one with its preface for [`OPENING_GRACE`], by when a set-up that
    /// is waiting for its own preface is behind. A newcomer to a full lobby closes the
    /// longest-waiting peer there that has sent no preface (or else the longest-waiting).
    fn send_to_lobby(&mut self, raw: Raw, opened: bool) {
        let live = &self.lobby_live;
        while self
            .lobby
            .front()
            .is_some_and(|(id, ..)| !live.contains(id))
        {
            self.lobby.pop_front();
        }
        let places = self.shared.config.max_handshakes * LOBBY_PER_SLOT;
        if live.len() >= places {
            // Under a flood the front is a peer with no preface, so this looks at one place.
            let i = (self.lobby.iter())
                .position(|(id, _, o)| !o && live.contains(id))
                .or_else(|| self.lobby.iter().position(|(id, ..)| live.contains(id)));
            if let Some((id, oldest, _)) = i.and_then(|i| self.lobby.remove(i)) {
                oldest.abort();
                self.lobby_live.remove(&id);
            }
        }
        // Ended entries behind the front leave too, before they outnumber the places.
        if self.lobby.len() > 2 * places {
            let live = &self.lobby_live;
            self.lobby.retain(|(id, ..)| live.contains(id));
        }
        let back = self.lobby_done.clone();
        let shared = self.shared.clone();
        let abort = self.setups.spawn(async move {
            let ready = if opened {
                tokio::time::sleep(OPENING_GRACE).await;
                true
            } else {
                tokio::time::timeout(LOBBY_WAIT, raw.await_opened())
                    .await
                    .is_ok()
            };
            if ready {
                // Full only when the acceptor is gone.
                let _ = back.try_send(raw);
            } else if let Some(held_back) = shared.warnings.allow() {
                let peer = raw.peer();
                tracing::warn!(%peer, held_back, "refused a connection: every set-up slot was taken and it sent no preface within {LOBBY_WAIT:?} (Config::max_handshakes, IBEX_MAX_HANDSHAKES)")
            }
        });
        self.lobby_live.insert(abort.id());
        self.lobby.push_back((abort.id(), abort, opened));
    }
}

/// A descriptor kept open to be given up when the process runs out of them, so that the
/// acceptor can still take a waiting peer off the backlog and close it, rather than leave
/// it there while every accept fails.
fn spare_descriptor() -> Option<std::fs::File> {
    std::fs::File::open("/dev/null").ok()
}

fn out_of_descriptors(e: &Error) -> bool {
    let Error::Io { source, .. } = e else {
        return false;
    };
    matches!(source.raw_os_error(), Some(libc::EMFILE | libc::ENFILE))
}

/// Accepts from `source` until aborted (the listener's drop aborts it, and with it every
/// set-up it started). See [`admit`] for who gets a set-up slot, and [`Conns::make_room`]
/// for the cap on connections.
pub(super) async fn run(source: Source, shared: Arc<Shared>) {
    let provider = source.provider();
    let homes = if source.homed() {
        shared.config.serve_threads
    } else {
        0
    };
    let (lobby_done, mut from_lobby) = mpsc::channel(shared.config.max_handshakes);
    let mut a = Acceptor {
        min_age: eviction_age(&shared.config),
        per_source: per_source(&shared.config),
        cap: max_connections(&shared.config),
        shared,
        homes,
        setups: JoinSet::new(),
        pending: VecDeque::new(),
        lobby: VecDeque::new(),
        lobby_live: HashSet::new(),
        lobby_done,
        views: Vec::new(),
    };
    let mut spare = spare_descriptor();
    let mut backoff = Duration::ZERO;
    loop {
        tokio::select! {
            r = source.accept() => match r {
                Ok(raw) => {
                    backoff = Duration::ZERO;
                    a.take(raw, false);
                }
                // Out of descriptors: give up the spare, take the waiting peer off the
                // backlog and close it, and take the spare back.
                Err(e) if out_of_descriptors(&e) && spare.is_some() => {
                    drop(spare.take());
                    let refused = tokio::time::timeout(Duration::from_millis(10), source.accept()).await;
                    let peer = match refused {
                        Ok(Ok(raw)) => Some(raw.peer()),
                        _ => None,
                    };
                    // The refused peer's socket is closed by now, which frees the spare's
                    // descriptor again.
                    spare = spare_descriptor();
                    if let Some(peer) = peer
                        && let Some(held_back) = a.shared.warnings.allow()
                    {
                        tracing::warn!(%peer, %e, held_back, provider, "refused a connection: the process is out of file descriptors; lower Config::max_connections (IBEX_MAX_CONNECTIONS, ibex-ps --max-connections) or raise ulimit -n")
                    }
                }
                // Out of descriptors and the like: the socket itself is fine, so pause (the
                // pause keeps a lasting failure from spinning) and go on.
                Err(e) => {
                    backoff = (backoff * 2).clamp(Duration::from_millis(5), Duration::from_secs(1));
                    tracing::warn!(%e, provider, retry_in = ?backoff, "listener: accepting failed");
                    tokio::time::sleep(backoff).await;
                    spare = spare.or_else(spare_descriptor);
                }
            },
            Some(raw) = from_lobby.recv() => a.take(raw, true),
            Some(ended) = a.setups.join_next_with_id(), if !a.setups.is_empty() => {
                let id = match ended {
                    Ok((id, ())) => id,
                    Err(e) => e.id(),
                };
                a.lobby_live.remove(&id);
            }
        }
    }
}

/// Sets one peer up under the deadline and hands the connection over; holds its slot
/// until `accept` has taken the connection, so unaccepted connections count against the
/// cap too.
async fn set_up(raw: Raw, shared: Arc<Shared>, slot: SlotGuard) {
    let peer = raw.peer();
    let config = &shared.config;
    // One deadline for the whole set-up. The protocol handshake gets what the provider's
    // part left of it, and enforces it itself, so a peer that stalls there is told why.
    let deadline = tokio::time::Instant::now() + config.handshake_timeout;
    let opening = async {
        if lock(&slot.0).stage == Stage::Opening {
            raw.await_opened().await;
            lock(&slot.0).stage = Stage::Opened;
        }
        raw.setup(config).await
    };
    let result = match tokio::time::timeout_at(deadline, opening).await {
        Ok(Ok(Some(link))) => {
            let left = deadline
                .saturating_duration_since(tokio::time::Instant::now())
                .max(Duration::from_millis(1));
            let config = Config {
                handshake_timeout: left,
                ..config.clone()
            };
            Connection::establish(link, &config).await.map(Some)
        }
        Ok(Ok(None)) => Ok(None),
        Ok(Err(e)) => Err(e),
        Err(_) => Err(Error::Timeout(format!(
            "{peer} did not finish connection set-up within {} ms (Config::handshake_timeout, IBEX_HANDSHAKE_TIMEOUT_MS); closed it",
            config.handshake_timeout.as_millis()
        ))),
    };
    match result {
        Ok(Some(conn)) => {
            lock(&slot.0).stage = Stage::Made;
            shared
                .conns
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .add(&conn);
            // Fails only when the listener is gone; the connection then closes with it.
            let _ = shared.ready.send(conn).await;
        }
        Ok(None) => tracing::debug!(%peer, "a connection closed before its first byte"),
        Err(e) => {
            if let Some(held_back) = shared.warnings.allow() {
                tracing::warn!(%peer, error = %e, held_back, "connection set-up failed; dropped that peer only")
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const AGE: Duration = Duration::from_millis(250);

    fn view(stage: Stage, age_ms: u64, source: u8) -> View {
        View {
            stage,
            age: Duration::from_millis(age_ms),
            source: Some(IpAddr::from([10, 0, 0, source])),
        }
    }

    fn src(n: u8) -> Option<IpAddr> {
        Some(IpAddr::from([10, 0, 0, n]))
    }

    #[test]
    fn a_ready_newcomer_takes_the_slot_of_the_oldest_peer_still_short_of_its_preface() {
        let v = [
            view(Stage::Opened, 100, 1),
            view(Stage::Opening, 5, 2),
            view(Stage::Opening, 30, 3),
            view(Stage::Opening, 60, 4),
        ];
        // Young by age, but past the grace for a preface that an honest peer sends at once.
        assert_eq!(admit(&v, false, true, src(9), 32, AGE), Admit::Evict(2));
        // A newcomer that has sent nothing yet takes nothing this young: it waits.
        assert_eq!(admit(&v, false, false, src(9), 32, AGE), Admit::Lobby);
        // A free slot goes to anyone.
        assert_eq!(admit(&v, true, false, src(9), 32, AGE), Admit::Free);
        // Nothing behind yet: even a ready newcomer waits a moment.
        let young = [view(Stage::Opening, 5, 2), view(Stage::Opened, 5, 3)];
        assert_eq!(admit(&young, false, true, src(9), 32, AGE), Admit::Lobby);
    }

    #[test]
    fn set_ups_getting_on_keep_their_slots_until_the_eviction_age() {
        let v = [view(Stage::Opened, 100, 1), view(Stage::Made, 900, 2)];
        assert_eq!(admit(&v, false, true, src(9), 32, AGE), Admit::Lobby);
        let v = [view(Stage::Made, 900, 2), view(Stage::Opened, 300, 1)];
        assert_eq!(admit(&v, false, false, src(9), 32, AGE), Admit::Evict(1));
    }

    #[test]
    fn one_source_holds_its_share_of_waiting_set_ups_at_most() {
        let v = [
            view(Stage::Opening, 400, 1),
            view(Stage::Opening, 30, 1),
            view(Stage::Opening, 5, 2),
        ];
        // Source 1 is at its share of 2: its newcomer with no preface takes its own
        // oldest once stale, even with slots free, and never another source's.
        assert_eq!(admit(&v, true, false, src(1), 2, AGE), Admit::Evict(0));
        let young = [view(Stage::Opening, 30, 1), view(Stage::Opening, 1, 1)];
        assert_eq!(admit(&young, true, false, src(1), 2, AGE), Admit::Lobby);
        // Its newcomer whose preface is there will not wait for one: it is no slowloris.
        assert_eq!(admit(&young, true, true, src(1), 2, AGE), Admit::Free);
        // Other sources are not held to it.
        assert_eq!(admit(&v, true, false, src(3), 2, AGE), Admit::Free);
        // Local peers have no source to bound.
        assert_eq!(admit(&young, true, false, None, 2, AGE), Admit::Free);
    }

    #[test]
    fn a_preface_is_judged_once_whole_or_once_it_is_plainly_none() {
        let ours = preface::Preface::ours(&Config::default(), vec![1, 2, 3])
            .unwrap()
            .encode(Provider::Tcp);
        for n in 0..ours.len() {
            assert!(!opened(Provider::Tcp, &ours[..n]), "{n} bytes");
        }
        assert!(opened(Provider::Tcp, &ours));
        assert!(opened(Provider::Tcp, b"GET / HTTP/1.1\r\nHost: x\r\n"));
        assert!(opened(Provider::Shm, &ours));
    }

    #[test]
    fn the_default_cap_on_connections_follows_the_descriptor_limit() {
        let c = Config::default();
        let n = max_connections(&c);
        assert!(n >= 1);
        assert_eq!(
            max_connections(&Config {
                max_connections: Some(7),
                ..c
            }),
            7
        );
    }

    #[test]
    fn warnings_are_limited_per_second_and_count_what_was_held_back() {
        let w = WarnLimit::default();
        for _ in 0..WARNINGS_PER_SEC {
            assert_eq!(w.allow(), Some(0));
        }
        for _ in 0..5 {
            assert_eq!(w.allow(), None);
        }
        // A second later the next warning goes out and says how many were held back.
        if let Some((start, _, _)) = w.state.lock().unwrap().as_mut() {
            *start -= Duration::from_secs(1);
        }
        assert_eq!(w.allow(), Some(5));
        assert_eq!(w.allow(), Some(0));
    }
}
