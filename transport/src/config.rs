//! Connection configuration, with the environment overrides users expect.

use crate::error::{Error, Result};

/// Tunables of one connection. Both sides may differ: what matters for the peer is
/// exchanged in the handshake (`Hello`).
#[derive(Debug, Clone)]
pub struct Config {
    /// Messages up to this size go eager, larger ones rendezvous. `None` = pick it with the
    /// probe at connection start (falls back to `default_eager_threshold` if the probe is off
    /// or fails). `IBEX_EAGER_THRESHOLD` overrides both.
    pub eager_threshold: Option<usize>,
    /// Threshold used until (or instead of) the probe's verdict.
    pub default_eager_threshold: usize,
    /// Run the connect-time probe (threshold and fragment size, where each is left open).
    /// Off, a threshold left open is `default_eager_threshold`.
    pub probe: bool,
    /// Let the probe pick the eager threshold when `eager_threshold` is `None`. Connections
    /// turn it off themselves where a rendezvous read is a CPU copy (shm, tcp: see
    /// `LinkInfo::dma_reads`); the threshold is then the largest message a slot of the
    /// peer's takes.
    pub probe_threshold: bool,
    /// A probe not finished by then is abandoned and the default threshold kept
    /// (`IBEX_PROBE_TIMEOUT_MS`; default 2 s, far above what a real link needs).
    pub probe_timeout: std::time::Duration,
    /// Size of one eager receive slot = the largest frame the peer may send us.
    pub slot_size: usize,
    /// Number of eager receive slots = data frames the peer may have outstanding (credits).
    pub credits: u32,
    /// Rendezvous fragment size (bytes per one-sided read). `None` = pick it with the probe
    /// at connection start, from the read bandwidth measured at a few candidate sizes (falls
    /// back to `default_fragment_size` if the probe is off, fails, or the peer cannot take
    /// part). `IBEX_FRAGMENT_SIZE` overrides both.
    pub fragment_size: Option<usize>,
    /// Fragment size used until (or instead of) the probe's verdict.
    pub default_fragment_size: usize,
    /// Let the probe pick the fragment size when `fragment_size` is `None`. Connections turn
    /// it off themselves on providers where the fragment size barely matters (shm's single
    /// CMA copy, tcp's stream): there the probe's read samples would only slow every connect.
    pub probe_fragments: bool,
    /// Reads in flight per connection.
    pub max_reads_in_flight: usize,
    /// Largest message this side accepts (default [`DEFAULT_MAX_MESSAGE_SIZE`]).
    pub max_message_size: u64,
    /// Bytes of rendezvous receives one connection may hold at once: announced by the peer,
    /// given memory by this side, and not yet taken by the application. An announcement
    /// past it waits (its credit with it) until earlier ones are taken; one message alone
    /// is always let through, so the bound is the larger of this and `max_message_size`
    /// (`IBEX_RNDV_RECV_BUDGET`; default [`DEFAULT_RNDV_RECV_BUDGET`]).
    pub rndv_recv_budget: usize,
    /// Size of the registered pool (shm: one shared segment per side and peer process, used
    /// by all connections between the two; verbs: the bound on the peer-readable slabs
    /// `Connection::alloc` draws from, per process and device, and the size of the one-piece
    /// `Connection::pool`, registered the first time something asks for it).
    /// `IBEX_POOL_SIZE`; default [`DEFAULT_POOL_SIZE`].
    pub pool_size: usize,
    /// verbs: upper bound on the local memory this process registers on one device for eager
    /// slots, send slots and RDMA READ destinations, shared by all its connections there
    /// (slabs registered on demand and given back when idle; `IBEX_VERBS_MEM_LIMIT`;
    /// default 1 GiB). Reaching it fails the receive or connect that needed more, naming it.
    pub verbs_mem_limit: usize,
    /// verbs: bytes of exposed buffers whose registrations stay cached after their last
    /// exposure, per process and device (`IBEX_REG_CACHE_SIZE`; default 64 MiB). Cached
    /// buffers are kept alive (the cache holds them) until evicted, least recently used first.
    pub reg_cache_size: usize,
    /// Optional shared secret that the peer must present at setup (`IBEX_AUTH_TOKEN`).
    pub auth_token: Option<String>,
    /// verbs: the RDMA device to use (e.g. `mlx5_0`, `rxe0`; `IBEX_RDMA_DEVICE`); `None` =
    /// the first device with an ACTIVE port and a usable GID.
    pub rdma_device: Option<String>,
    /// verbs: the device port, from 1 (`IBEX_RDMA_PORT`); `None` = the first ACTIVE port.
    pub rdma_port: Option<u8>,
    /// verbs: the GID table index (`IBEX_GID_INDEX`); `None` = a RoCE v2 GID (IPv4-mapped
    /// first) on Ethernet, index 0 on InfiniBand.
    pub gid_index: Option<u32>,
    /// verbs: spin on the completion queue in a dedicated thread per link instead of
    /// spinning briefly and then sleeping on the completion channel
    /// (`IBEX_VERBS_BUSY_POLL=1`).
    pub verbs_busy_poll: bool,
    /// verbs: how long the completion queue is polled empty before the link sleeps on its
    /// completion channel (`IBEX_VERBS_SPIN_US`; default [`VERBS_SPIN`]).
    pub verbs_spin: std::time::Duration,
    /// shm: how long a sender spins for ring space before it sleeps on an eventfd
    /// (`IBEX_SHM_SPIN_US`; default [`SHM_SPIN`]; zero never spins).
    pub shm_spin: std::time::Duration,
    /// shm: this side reads rendezvous data through the peer's bounce area rather than with
    /// a CMA copy (`IBEX_SHM_FORCE_BOUNCE=1`), to test or compare the fallback path.
    pub shm_force_bounce: bool,
    /// Where [`crate::listen_auto`] puts its shm socket and [`crate::connect_auto`] looks
    /// for it (`IBEX_SHM_DIR`, else `XDG_RUNTIME_DIR`, else `/tmp`, the default here).
    pub shm_dir: std::path::PathBuf,
    /// The provider [`crate::connect_auto`] uses instead of picking one: `shm`, `tcp` or
    /// `verbs` (`IBEX_TRANSPORT`; `None`, the default, picks). Checked when it is used, so
    /// that a value meant for another layer (a worker's `grpc`) fails only there.
    pub auto_transport: Option<String>,
    /// How long a receiver that finds nothing busy-polls the link before it sleeps
    /// (`IBEX_SPIN_US`; default 100 µs; zero never spins). The spin yields to the runtime
    /// between polls, so tasks that are ready run first; a few hundred µs buys the lowest
    /// latency for CPU. From [`INLINE_READ_MIN_SPIN`] up (the default included), the
    /// receiver spins on the link itself rather than through the connection's driver task.
    pub spin: std::time::Duration,
    /// How long a peer has to finish connection set-up (the provider's preface and the
    /// protocol handshake) before it is dropped: a listener's deadline per accepted peer,
    /// and a connecting side's wait for the peer's handshake (`IBEX_HANDSHAKE_TIMEOUT_MS`;
    /// default 5 s). Short, because a listener holds a set-up slot for a peer until then.
    pub handshake_timeout: std::time::Duration,
    /// Set-ups a listener runs at once. A peer that arrives while all are taken gets the
    /// slot of one that is still short of its preface, or waits briefly for one, or is
    /// closed, so a flood of silent or dripping connections costs only its own peers,
    /// never the accept loop or an honest peer (`IBEX_MAX_HANDSHAKES`; default 128).
    pub max_handshakes: usize,
    /// A gRPC server's budget for what its clients make it hold, over all connections:
    /// request bytes handlers have not taken, calls in flight, answers waiting for send room
    /// (`IBEX_MAX_MEMORY`; default [`default_max_memory`]). Past it, connections holding
    /// more than a small floor stop reading and their new calls get `RESOURCE_EXHAUSTED`;
    /// lighter connections are still served.
    pub max_memory: usize,
    /// Connections a listener keeps open at once, set up and handed to `accept`. Past it, a
    /// newcomer takes the place of the connection that has carried no message for longest
    /// (at least a second), or is closed at once when there is none. `None` (the default)
    /// derives it from the process's descriptor limit (`RLIMIT_NOFILE`, `ulimit -n`) less a
    /// reserve for set-ups and the process's own files, so the listener never runs out of
    /// descriptors (`IBEX_MAX_CONNECTIONS`; `ibex-ps --max-connections`).
    pub max_connections: Option<usize>,
    /// A listener serves each accepted shm connection on one of this many threads of
    /// Ibex's own, each a runtime with one worker: the connection's set-up, its driver, the
    /// gRPC server's reader and the handlers it polls all stay on that thread, and no other
    /// worker steals them or is woken to look for work (`IBEX_SERVE_THREADS`; default 0:
    /// the accepting runtime serves them), which keeps the tail latency down. A handler keeps
    /// tokio's rules there: what it spawns runs on
    /// the server's runtime and `block_in_place` works, but a handler that blocks without
    /// it holds up that thread's other connections (docs/grpc.md). tcp and verbs
    /// connections stay on the accepting runtime.
    pub serve_threads: usize,
    /// tcp: probe an idle connection after this long and close it when the peer stops
    /// answering (TCP keep-alive: three probes a third of this apart), so a peer that
    /// vanished without closing (a partition, a powered-off host) is noticed within about
    /// twice this. `None` (the default, as in tonic) leaves it to the calls' deadlines.
    /// shm peers are local, and their death is seen at once; verbs queue pairs time out
    /// on their own.
    pub tcp_keepalive: Option<std::time::Duration>,
    /// Ping the peer over the connection after this long without hearing from it, and
    /// close the connection when nothing comes back within [`Config::keepalive_timeout`]:
    /// a peer that hangs (a stopped process, a partition, a host gone) is noticed within
    /// about their sum on every provider, as with tonic's `http2_keep_alive_interval`. A
    /// ping is one empty probe frame the peer answers (older peers answer it too). `None`
    /// (the default, as in tonic) leaves it to the calls' deadlines (`IBEX_KEEPALIVE_MS`).
    pub keepalive: Option<std::time::Duration>,
    /// How long a keep-alive ping may go unanswered before the connection is closed
    /// (`IBEX_KEEPALIVE_TIMEOUT_MS`; default 20 s, tonic's).
    pub keepalive_timeout: std::time::Duration,
    /// TLS for the tcp provider ([`crate::tls`]): a listener's certificate (and the CAs of
    /// the clients it accepts), or a client's roots (and its own certificate for mutual
    /// TLS). The handshake runs before the Ibex preface, so the auth token travels
    /// encrypted. Ignored on shm (a local peer, checked by the kernel's credentials of its
    /// socket); refused on verbs, whose RDMA traffic it cannot cover. `None` (the
    /// default): plain tcp.
    pub tls: Option<crate::tls::Tls>,
    /// Which settings [`Config::with_env`] took from the environment, so that statistics
    /// can say `"env"` rather than `"config"`.
    pub env_overrides: EnvOverrides,
}

/// Settings that came from environment variables (see [`Config::env_overrides`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EnvOverrides {
    /// `eager_threshold` came from `IBEX_EAGER_THRESHOLD`.
    pub eager_threshold: bool,
    /// `fragment_size` came from `IBEX_FRAGMENT_SIZE`.
    pub fragment_size: bool,
}

/// The default of [`Config::max_memory`]: a quarter of the machine's memory, so that a
/// server that reaches it still leaves room for its own state (a PS's variables) and the
/// rest of the machine; at least [`MIN_MAX_MEMORY`].
pub fn default_max_memory() -> usize {
    // SAFETY: sysconf reads a system value and has no memory effects.
    let (pages, page) = unsafe {
        (
            libc::sysconf(libc::_SC_PHYS_PAGES),
            libc::sysconf(libc::_SC_PAGESIZE),
        )
    };
    let total = usize::try_from(pages)
        .ok()
        .zip(usize::try_from(page).ok())
        .map_or(4 << 30, |(n, p)| n.saturating_mul(p));
    (total / 4).max(MIN_MAX_MEMORY)
}

/// The least [`Config::max_memory`]: room for a few large messages in flight.
pub const MIN_MAX_MEMORY: usize = 64 << 20;

/// Most threads [`Config::serve_threads`] may ask for.
pub const MAX_SERVE_THREADS: usize = 1024;

impl Default for Config {
    fn default() -> Self {
        Config {
            eager_threshold: None,
            default_eager_threshold: 16 * 1024,
            probe: true,
            probe_timeout: crate::proto::PROBE_TIMEOUT,
            slot_size: 64 * 1024,
            credits: 64,
            fragment_size: None,
            default_fragment_size: 512 * 1024,
            probe_fragments: true,
            probe_threshold: true,
            max_reads_in_flight: 8,
            max_message_size: DEFAULT_MAX_MESSAGE_SIZE,
            rndv_recv_budget: DEFAULT_RNDV_RECV_BUDGET,
            pool_size: DEFAULT_POOL_SIZE,
            verbs_mem_limit: 1 << 30,
            reg_cache_size: 64 << 20,
            auth_token: None,
            rdma_device: None,
            rdma_port: None,
            gid_index: None,
            verbs_busy_poll: false,
            verbs_spin: VERBS_SPIN,
            shm_spin: SHM_SPIN,
            shm_force_bounce: false,
            shm_dir: std::path::PathBuf::from(DEFAULT_SHM_DIR),
            auto_transport: None,
            spin: DEFAULT_SPIN,
            handshake_timeout: std::time::Duration::from_secs(5),
            max_handshakes: 128,
            max_memory: default_max_memory(),
            max_connections: None,
            serve_threads: 0,
            tcp_keepalive: None,
            keepalive: None,
            keepalive_timeout: std::time::Duration::from_secs(20),
            tls: None,
            env_overrides: EnvOverrides::default(),
        }
    }
}

impl Config {
    /// The default configuration with environment overrides applied
    /// (`IBEX_EAGER_THRESHOLD`, `IBEX_FRAGMENT_SIZE`, `IBEX_PROBE_TIMEOUT_MS`, `IBEX_SPIN_US`,
    /// `IBEX_AUTH_TOKEN`, `IBEX_HANDSHAKE_TIMEOUT_MS`, `IBEX_MAX_HANDSHAKES`, `IBEX_MAX_MEMORY`,
    /// `IBEX_MAX_CONNECTIONS`,
    /// `IBEX_RNDV_RECV_BUDGET`, `IBEX_KEEPALIVE_MS`, `IBEX_KEEPALIVE_TIMEOUT_MS`,
    /// `IBEX_POOL_SIZE`, `IBEX_SERVE_THREADS`, `IBEX_BUSY_POLL`, `IBEX_SHM_SPIN_US`,
    /// `IBEX_SHM_FORCE_BOUNCE`, `IBEX_SHM_DIR` / `XDG_RUNTIME_DIR`, `IBEX_TRANSPORT`,
    /// `IBEX_RDMA_DEVICE`, `IBEX_RDMA_PORT`, `IBEX_GID_INDEX`, `IBEX_VERBS_BUSY_POLL`,
    /// `IBEX_VERBS_SPIN_US`). The library reads the environment nowhere else: binaries
    /// call this, and every entry point takes the `Config` it returns.
    pub fn from_env() -> Result<Self> {
        Config::default().with_env()
    }

    /// Busy-polling, as one setting (`IBEX_BUSY_POLL=1`): a waiting receiver spins
    /// [`BUSY_SPIN`] before it sleeps, and a listener serves its shm connections on
    /// [`busy_serve_threads`] threads of Ibex's own ([`Config::serve_threads`]), so the
    /// readers that spin do it on threads of their own, as eRPC's dispatch threads do, and
    /// no worker of the application's runtime steals their tasks or is woken by them.
    /// That is what keeps a busy-polling server's tail below the default's; the longer spin
    /// alone does not. A
    /// handler that blocks without `block_in_place` then holds up its serve thread's other
    /// connections (docs/grpc.md, "Serve threads"). Fields set afterwards, and
    /// `IBEX_SPIN_US` / `IBEX_SERVE_THREADS` in [`Config::with_env`], still win.
    pub fn busy_poll(mut self) -> Self {
        self.spin = BUSY_SPIN;
        self.serve_threads = busy_serve_threads();
        self
    }

    /// Applies environment overrides on top of `self`.
    pub fn with_env(mut self) -> Result<Self> {
        // First, so that the settings it stands for can still be overridden one by one.
        if env_switch("IBEX_BUSY_POLL")? {
            self = self.busy_poll();
        }
        if let Some(v) = env_usize("IBEX_EAGER_THRESHOLD")? {
            self.eager_threshold = Some(v);
            self.env_overrides.eager_threshold = true;
        }
        if let Some(v) = env_usize("IBEX_FRAGMENT_SIZE")? {
            self.fragment_size = Some(v);
            self.env_overrides.fragment_size = true;
        }
        if let Some(v) = env_usize("IBEX_MAX_MEMORY")? {
            self.max_memory = v;
        }
        if let Some(v) = env_usize("IBEX_RNDV_RECV_BUDGET")? {
            self.rndv_recv_budget = v;
        }
        if let Some(v) = env_usize("IBEX_VERBS_MEM_LIMIT")? {
            self.verbs_mem_limit = v;
        }
        if let Some(v) = env_usize("IBEX_REG_CACHE_SIZE")? {
            self.reg_cache_size = v;
        }
        if let Some(v) = env_usize("IBEX_POOL_SIZE")? {
            self.pool_size = v;
        }
        if let Some(t) = env_millis("IBEX_PROBE_TIMEOUT_MS", 2000)? {
            self.probe_timeout = t;
        }
        if let Some(t) = env_millis("IBEX_HANDSHAKE_TIMEOUT_MS", 5000)? {
            self.handshake_timeout = t;
        }
        if let Some(t) = env_millis("IBEX_KEEPALIVE_MS", 10_000)? {
            self.keepalive = Some(t);
        }
        if let Some(t) = env_millis("IBEX_KEEPALIVE_TIMEOUT_MS", 20_000)? {
            self.keepalive_timeout = t;
        }
        if let Some(n) = env_positive("IBEX_MAX_HANDSHAKES", "number", 128)? {
            self.max_handshakes = usize::try_from(n).unwrap_or(usize::MAX);
        }
        if let Some(n) = env_positive("IBEX_MAX_CONNECTIONS", "number", 1000)? {
            self.max_connections = Some(usize::try_from(n).unwrap_or(usize::MAX));
        }
        if let Ok(v) = std::env::var("IBEX_SERVE_THREADS") {
            self.serve_threads = v.trim().parse::<usize>().map_err(|_| {
                Error::Config(format!("IBEX_SERVE_THREADS={v:?} is not a number of threads (examples: 0 serves on the accepting runtime, 2 on two threads of Ibex's own)"))
            })?;
        }
        if let Ok(v) = std::env::var("IBEX_SPIN_US") {
            let us = v.trim().parse::<u64>().map_err(|_| {
                Error::Config(format!("IBEX_SPIN_US={v:?} is not a number of microseconds (examples: 0 never spins, 100 is the default, 500 for lowest latency)"))
            })?;
            self.spin = std::time::Duration::from_micros(us);
        }
        if let Ok(t) = std::env::var("IBEX_AUTH_TOKEN")
            && !t.is_empty()
        {
            self.auth_token = Some(t);
        }
        if let Some(us) = env_number("IBEX_SHM_SPIN_US", "example: 30; 0 never spins")? {
            self.shm_spin = std::time::Duration::from_micros(us);
        }
        if std::env::var("IBEX_SHM_FORCE_BOUNCE").is_ok_and(|v| v == "1") {
            self.shm_force_bounce = true;
        }
        if let Some(dir) = env_shm_dir() {
            self.shm_dir = dir;
        }
        if let Some(t) = env_nonempty("IBEX_TRANSPORT") {
            self.auto_transport = Some(t);
        }
        if let Some(d) = env_nonempty("IBEX_RDMA_DEVICE") {
            self.rdma_device = Some(d);
        }
        if let Some(p) = env_number("IBEX_RDMA_PORT", "example: 1")? {
            self.rdma_port = Some(
                u8::try_from(p)
                    .ok()
                    .filter(|&p| p > 0)
                    .ok_or_else(|| Error::Config(format!("IBEX_RDMA_PORT={p} must be 1..=255")))?,
            );
        }
        if let Some(i) = env_number("IBEX_GID_INDEX", "example: 1")? {
            self.gid_index = Some(u32::try_from(i).map_err(|_| {
                Error::Config(format!("IBEX_GID_INDEX={i} is not a GID table index"))
            })?);
        }
        match env_nonempty("IBEX_VERBS_BUSY_POLL").as_deref() {
            None | Some("0") | Some("false") | Some("no") => {}
            Some("1") | Some("true") | Some("yes") => self.verbs_busy_poll = true,
            Some(v) => {
                return Err(Error::Config(format!(
                    "IBEX_VERBS_BUSY_POLL={v:?}: use 1 or 0"
                )));
            }
        }
        if let Some(us) = env_number("IBEX_VERBS_SPIN_US", "example: 20")? {
            self.verbs_spin = std::time::Duration::from_micros(us);
        }
        self.validate()?;
        Ok(self)
    }

    /// Checks that the values fit together.
    pub fn validate(&self) -> Result<()> {
        if !(MIN_SLOT_SIZE..=MAX_SLOT_SIZE).contains(&self.slot_size) {
            return Err(Error::Config(format!(
                "slot_size {} must be within 1 KiB..=16 MiB",
                self.slot_size
            )));
        }
        if self.credits == 0 || self.credits > 65_536 {
            return Err(Error::Config(format!(
                "credits {} must be within 1..=65536",
                self.credits
            )));
        }
        for (name, f) in [
            ("fragment_size", self.fragment_size),
            ("default_fragment_size", Some(self.default_fragment_size)),
        ] {
            if let Some(f) = f
                && !(MIN_FRAGMENT..=MAX_FRAGMENT).contains(&f)
            {
                return Err(Error::Config(format!(
                    "{name} {f} must be within 4 KiB..=64 MiB (IBEX_FRAGMENT_SIZE sets fragment_size)"
                )));
            }
        }
        if self.max_memory < MIN_MAX_MEMORY {
            return Err(Error::Config(format!(
                "max_memory {} is below the least a server can work in, {} MiB \
                 (IBEX_MAX_MEMORY or ibex-ps --max-memory sets it, e.g. 1G)",
                self.max_memory,
                MIN_MAX_MEMORY >> 20
            )));
        }
        if self.rndv_recv_budget == 0 {
            return Err(Error::Config(
                "rndv_recv_budget must be above zero (IBEX_RNDV_RECV_BUDGET sets it, e.g. 256M)"
                    .into(),
            ));
        }
        if self.verbs_mem_limit < VERBS_SLAB {
            return Err(Error::Config(format!(
                "verbs_mem_limit {} must be at least one {} MiB slab (IBEX_VERBS_MEM_LIMIT sets it, e.g. 1G)",
                self.verbs_mem_limit,
                VERBS_SLAB >> 20
            )));
        }
        if self.handshake_timeout.is_zero() {
            return Err(Error::Config(
                "handshake_timeout must be above zero (IBEX_HANDSHAKE_TIMEOUT_MS sets it)".into(),
            ));
        }
        if self.keepalive.is_some_and(|k| k.is_zero()) || self.keepalive_timeout.is_zero() {
            return Err(Error::Config(
                "keepalive and keepalive_timeout must be above zero (IBEX_KEEPALIVE_MS, IBEX_KEEPALIVE_TIMEOUT_MS set them; leave keepalive unset to turn pings off)".into(),
            ));
        }
        if self.max_handshakes == 0 {
            return Err(Error::Config(
                "max_handshakes must be at least 1 (IBEX_MAX_HANDSHAKES sets it)".into(),
            ));
        }
        if self.max_connections == Some(0) {
            return Err(Error::Config(
                "max_connections must be at least 1, or unset to follow the descriptor limit (IBEX_MAX_CONNECTIONS sets it)".into(),
            ));
        }
        if self.serve_threads > MAX_SERVE_THREADS {
            return Err(Error::Config(format!(
                "serve_threads {} is more than {MAX_SERVE_THREADS}: one or two per core is what pays (IBEX_SERVE_THREADS sets it)",
                self.serve_threads
            )));
        }
        if self.max_reads_in_flight == 0 {
            return Err(Error::Config(
                "max_reads_in_flight must be at least 1".into(),
            ));
        }
        if let Some(t) = self.eager_threshold
            && t > self.max_eager()
        {
            return Err(Error::Config(format!(
                "eager threshold {t} exceeds what fits in one slot ({}); raise slot_size or lower IBEX_EAGER_THRESHOLD",
                self.max_eager()
            )));
        }
        Ok(())
    }

    /// The largest message that can travel eagerly with this slot size.
    pub fn max_eager(&self) -> usize {
        self.slot_size - crate::proto::EAGER_OVERHEAD
    }

    /// True when the connect-time probe should run: it is on, and the eager threshold or the
    /// fragment size is left for it to pick.
    pub fn wants_probe(&self) -> bool {
        self.probe
            && ((self.eager_threshold.is_none() && self.probe_threshold) || self.probes_fragments())
    }

    /// Whether the eager threshold is the largest message a slot takes, because the link
    /// says eager always wins there ([`Config::probe_threshold`] off, probe on, nothing
    /// configured).
    pub fn threshold_by_link(&self) -> bool {
        self.probe && self.eager_threshold.is_none() && !self.probe_threshold
    }

    /// Whether the fragment size is left to the probe.
    pub fn probes_fragments(&self) -> bool {
        self.fragment_size.is_none() && self.probe_fragments
    }

    /// Bytes of the zero buffer the probe's rendezvous samples read: the largest eager
    /// candidate, or the fragment samples' length when the fragment size is to be probed.
    pub fn probe_buffer_len(&self) -> usize {
        let frag = if self.probes_fragments() {
            crate::proto::FRAGMENT_PROBE_LEN
        } else {
            0
        };
        self.max_eager().max(frag)
    }
}

/// Smallest fragment size a configuration (or a peer's probe sample) may ask for.
pub const MIN_FRAGMENT: usize = 4096;
/// The default of [`Config::spin`]: long enough to catch a reply that a crowded machine
/// delays past 50 µs, and to read inline ([`INLINE_READ_MIN_SPIN`]). It trades some of the
/// raw transport's p99 for gRPC's PS throughput and median.
pub const DEFAULT_SPIN: std::time::Duration = std::time::Duration::from_micros(100);
/// [`Config::spin`] with busy-polling on ([`Config::busy_poll`]): RR-Compound's default
/// spin before it falls back to epoll.
pub const BUSY_SPIN: std::time::Duration = std::time::Duration::from_micros(500);

/// The serve threads of [`Config::busy_poll`]: half the cores, at least one. An shm peer
/// runs on the same host and needs cores too, and the application's runtime keeps the
/// rest; more serve threads than that take cores the peers need.
pub fn busy_serve_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| (n.get() / 2).max(1))
}

/// From this [`Config::spin`] up, a waiting receiver polls the link on its own task instead
/// of having the connection's driver poll it and wake it (docs/transport.md, "Progress"):
/// faster round trips, which a shorter budget pays for in tail latency and PS throughput.
pub const INLINE_READ_MIN_SPIN: std::time::Duration = std::time::Duration::from_micros(100);
/// How long a receiver reading the link inline watches its [`crate::link::ReadyHint`]
/// between two empty reads before it goes back to its runtime: this many `pause`s (about
/// 25 ns each on this project's AMD machines, 40-140 cycles on others), so at most 1-3 µs
/// that the runtime's other tasks on the thread wait.
pub const INLINE_WATCH_PAUSES: u32 = 40;
/// A receiver watches ([`INLINE_WATCH_PAUSES`]) only while its answered spins have been
/// waiting this long at most (smoothed): a ping-pong's replies, not a crowded machine's.
/// Watching on every wait would cost PS workloads, whose replies take tens of microseconds
/// and whose serve threads run several connections each.
pub const INLINE_WATCH_REPLIES: std::time::Duration = std::time::Duration::from_micros(4);
/// Largest fragment size a configuration (or a peer's probe sample) may ask for.
pub const MAX_FRAGMENT: usize = 64 << 20;
/// The default of [`Config::max_message_size`]: one message may carry a whole shard's
/// tensors (a PS's pull reply), and a peer's announcement past it is a protocol violation, so
/// no peer makes this side allocate more for one message (docs/security.md).
pub const DEFAULT_MAX_MESSAGE_SIZE: u64 = 1 << 30;
/// Smallest eager slot a configuration may ask for, and a peer may announce in any
/// provider's handshake: one bound for both, so no peer can make us accept absurd frames.
pub const MIN_SLOT_SIZE: usize = 1024;
/// Largest eager slot a configuration may ask for, and a peer may announce in any
/// provider's handshake (see [`MIN_SLOT_SIZE`]).
pub const MAX_SLOT_SIZE: usize = 16 << 20;
/// The default of [`Config::rndv_recv_budget`]: the memory a peer can make one connection
/// hold for rendezvous receives (docs/security.md). The gRPC server's default for the
/// request bodies it holds for handlers is the same bound.
pub const DEFAULT_RNDV_RECV_BUDGET: usize = 256 << 20;
/// The default of [`Config::pool_size`]: the zero-copy memory a process maps per shm peer
/// process, or registers per verbs device, for buffers from `Connection::alloc`. Past it,
/// allocations fall back to heap memory where callers allow (the worker's staging cache,
/// docs/ps.md), so it bounds pinned memory, not what can be sent.
pub const DEFAULT_POOL_SIZE: usize = 256 << 20;
/// verbs: the size of one slab of local registered memory. Small enough that registering
/// one is quick (about 30 ms under full emulation, microseconds on hardware), large
/// enough that a busy process needs few; [`Config::verbs_mem_limit`] holds one at least.
pub const VERBS_SLAB: usize = 4 << 20;
/// The default of [`Config::shm_spin`]: the consumer of a full ring is another process,
/// usually draining it right now. Receive-side spinning is the driver's
/// ([`Config::spin`]), since only it knows whether other work is waiting.
pub const SHM_SPIN: std::time::Duration = std::time::Duration::from_micros(30);
/// The default of [`Config::verbs_spin`]: long enough to catch a reply on a fast network,
/// short enough not to matter when idle.
pub const VERBS_SPIN: std::time::Duration = std::time::Duration::from_micros(20);
/// The last choice of [`Config::shm_dir`], where neither `IBEX_SHM_DIR` nor
/// `XDG_RUNTIME_DIR` names one.
pub const DEFAULT_SHM_DIR: &str = "/tmp";

/// The shm socket directory the environment names (`IBEX_SHM_DIR`, else
/// `XDG_RUNTIME_DIR`), as [`Config::from_env`] reads it into [`Config::shm_dir`]. Public for
/// spec modules that name a job's shm sockets before any `Config` exists.
pub fn env_shm_dir() -> Option<std::path::PathBuf> {
    std::env::var_os("IBEX_SHM_DIR")
        .or_else(|| std::env::var_os("XDG_RUNTIME_DIR"))
        .map(std::path::PathBuf::from)
}

/// A variable's value, unset and empty alike being `None`.
fn env_nonempty(name: &str) -> Option<String> {
    std::env::var(name).ok().filter(|v| !v.is_empty())
}

/// A non-negative integer from `name`; `example` goes into the error.
fn env_number(name: &str, example: &str) -> Result<Option<u64>> {
    env_nonempty(name)
        .map(|v| {
            v.trim()
                .parse::<u64>()
                .map_err(|_| Error::Config(format!("{name}={v:?} is not a number ({example})")))
        })
        .transpose()
}

/// A positive number of milliseconds from `name`; `example` goes into the error.
fn env_millis(name: &str, example: u64) -> Result<Option<std::time::Duration>> {
    Ok(
        env_positive(name, "number of milliseconds", example)?
            .map(std::time::Duration::from_millis),
    )
}

/// A positive integer from `name`; `what` and `example` go into the error.
fn env_positive(name: &str, what: &str, example: u64) -> Result<Option<u64>> {
    match std::env::var(name) {
        Ok(v) => v
            .trim()
            .parse::<u64>()
            .ok()
            .filter(|&n| n > 0)
            .map(Some)
            .ok_or_else(|| {
                Error::Config(format!(
                    "{name}={v:?} is not a positive {what} (example: {example})"
                ))
            }),
        Err(_) => Ok(None),
    }
}

/// An on/off setting: unset is off.
fn env_switch(name: &str) -> Result<bool> {
    parse_switch(name, std::env::var(name).ok().as_deref())
}

fn parse_switch(name: &str, v: Option<&str>) -> Result<bool> {
    let Some(v) = v else { return Ok(false) };
    match v.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "on" | "yes" => Ok(true),
        "0" | "false" | "off" | "no" | "" => Ok(false),
        _ => Err(Error::Config(format!(
            "{name}={v:?} is neither on nor off (examples: 1 turns it on, 0 off)"
        ))),
    }
}

fn env_usize(name: &str) -> Result<Option<usize>> {
    match std::env::var(name) {
        Ok(v) => parse_size(&v).map(Some).ok_or_else(|| {
            Error::Config(format!(
                "{name}={v:?} is not a size (examples: 8192, 16K, 1M)"
            ))
        }),
        Err(_) => Ok(None),
    }
}

/// Parses `8192`, `16K`, `16KiB`, `1M`, `1MiB`, `1G`.
pub fn parse_size(s: &str) -> Option<usize> {
    let s = s.trim();
    let lower = s.to_ascii_lowercase();
    let (num, mult) = if let Some(n) = lower.strip_suffix("kib").or(lower.strip_suffix('k')) {
        (n, 1usize << 10)
    } else if let Some(n) = lower.strip_suffix("mib").or(lower.strip_suffix('m')) {
        (n, 1 << 20)
    } else if let Some(n) = lower.strip_suffix("gib").or(lower.strip_suffix('g')) {
        (n, 1 << 30)
    } else {
        (lower.as_str(), 1)
    };
    num.trim().parse::<usize>().ok()?.checked_mul(mult)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn busy_polling_is_one_setting() {
        let c = Config::default().busy_poll();
        assert_eq!(c.spin, BUSY_SPIN);
        assert!(c.serve_threads >= 1 && c.serve_threads == busy_serve_threads());
        c.validate().unwrap();
        assert!(parse_switch("IBEX_BUSY_POLL", Some(" On ")).unwrap());
        assert!(!parse_switch("IBEX_BUSY_POLL", Some("0")).unwrap());
        assert!(!parse_switch("IBEX_BUSY_POLL", None).unwrap());
        let e = parse_switch("IBEX_BUSY_POLL", Some("fast")).unwrap_err();
        assert!(e.to_string().contains("IBEX_BUSY_POLL=\"fast\""), "{e}");
    }

    #[test]
    fn sizes_parse() {
        assert_eq!(parse_size("8192"), Some(8192));
        assert_eq!(parse_size("16K"), Some(16384));
        assert_eq!(parse_size("1MiB"), Some(1 << 20));
        assert_eq!(parse_size("x"), None);
    }

    #[test]
    fn fragment_sizes_are_bounded() {
        let c = Config {
            fragment_size: Some(1000),
            ..Config::default()
        };
        assert!(matches!(c.validate(), Err(Error::Config(m)) if m.contains("fragment_size 1000")));
        let c = Config {
            default_fragment_size: 128 << 20,
            ..Config::default()
        };
        assert!(
            matches!(c.validate(), Err(Error::Config(m)) if m.contains("default_fragment_size"))
        );
        assert!(
            Config {
                fragment_size: Some(64 << 10),
                ..Config::default()
            }
            .validate()
            .is_ok()
        );
    }

    #[test]
    fn the_probe_runs_while_something_is_left_to_pick() {
        let d = Config::default();
        assert!(d.wants_probe());
        assert_eq!(d.probe_buffer_len(), crate::proto::FRAGMENT_PROBE_LEN);
        let t = Config {
            eager_threshold: Some(4096),
            ..Config::default()
        };
        assert!(t.wants_probe(), "the fragment size is still open");
        let both = Config {
            fragment_size: Some(1 << 20),
            ..t.clone()
        };
        assert!(!both.wants_probe());
        assert_eq!(
            Config {
                fragment_size: Some(1 << 20),
                ..Config::default()
            }
            .probe_buffer_len(),
            d.max_eager()
        );
        assert!(
            !Config {
                probe: false,
                ..Config::default()
            }
            .wants_probe()
        );
    }

    #[test]
    fn accept_limits_must_be_positive_and_name_their_variable() {
        let c = Config {
            handshake_timeout: std::time::Duration::ZERO,
            ..Config::default()
        };
        assert!(
            matches!(c.validate(), Err(Error::Config(m)) if m.contains("IBEX_HANDSHAKE_TIMEOUT_MS"))
        );
        let c = Config {
            max_handshakes: 0,
            ..Config::default()
        };
        assert!(matches!(c.validate(), Err(Error::Config(m)) if m.contains("IBEX_MAX_HANDSHAKES")));
        let c = Config {
            max_connections: Some(0),
            ..Config::default()
        };
        assert!(
            matches!(c.validate(), Err(Error::Config(m)) if m.contains("IBEX_MAX_CONNECTIONS"))
        );
        let c = Config {
            serve_threads: MAX_SERVE_THREADS + 1,
            ..Config::default()
        };
        assert!(matches!(c.validate(), Err(Error::Config(m)) if m.contains("IBEX_SERVE_THREADS")));
    }

    #[test]
    fn threshold_must_fit_a_slot() {
        let c = Config {
            eager_threshold: Some(1 << 20),
            ..Config::default()
        };
        assert!(matches!(c.validate(), Err(Error::Config(m)) if m.contains("slot")));
    }
}
