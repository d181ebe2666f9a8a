//! One [`Domain`] per process and device: the opened device context, its protection domain
//! and everything registered on it, shared by every connection on that device.
//!
//! Before, each connection opened the device, allocated its own protection domain and
//! registered its own pool (256 MiB by default), receive slab and send ring at connect: about
//! 336 MiB pinned per connection, so a parameter server with a handful of workers was
//! OOM-killed. Now:
//!
//! - **Local slabs** ([`SlabSet`]): memory registered for local access only (eager receive
//!   slots, send slots, RDMA READ destinations), in slabs of [`SLAB`] bytes (larger for a
//!   larger single request) registered on demand, carved with the first-fit [`Pool`], and
//!   deregistered by the domain's thread once they have been entirely free for a while. Total
//!   bounded by `Config::verbs_mem_limit`. Never remotely readable: no rkey of it is given out.
//! - **Peer-readable slabs** (`Registrar::alloc`, `Connection::alloc`): the same, registered
//!   for remote read, for buffers the application allocates in order to expose them (staged
//!   gradients, pull snapshots); bounded by `Config::pool_size`. Exposing them registers
//!   nothing, and they stay registered from step to step.
//! - **The user pool** (`Link::pool`): one per domain, `Config::pool_size` bytes, registered
//!   for remote read the first time someone asks for it, never at connect.
//! - **The registration cache** ([`RegCache`]): registrations of exposed buffers outlive their
//!   exposure and are reused on a hit. An entry holds a clone of the `Bytes` it registered, so
//!   the memory cannot be freed or unmapped while registered: a later buffer at the same
//!   address is the same live memory, never a stale mapping (the classic registration-cache
//!   bug, BytePS's among them). Entries no exposure uses are evicted least recently used first
//!   once their bytes pass `Config::reg_cache_size` (or their count passes [`CACHE_ENTRIES`]);
//!   eviction releases the `Bytes` and deregisters.
//! - **The domain thread** (`ibex-verbs-<dev>`): reads the device's asynchronous events and
//!   hands each to the link whose queue pair it names (a context has one event fd, so links
//!   sharing it cannot each read it), registers new slabs ahead of need (so registration
//!   leaves the runtime threads and the connection lock), deregisters idle slabs and evicted
//!   cache entries.
//!
//! Domains live as long as the process (a handful at most: one per device, port and GID
//! choice); what they hold shrinks back when connections go idle.

use std::collections::{BTreeMap, HashMap};
use std::os::fd::RawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::task::{Context, Waker};
use std::time::Duration;

use bytes::Bytes;
use rdma_mummy_sys as sys;
use sideway::ibverbs::AccessFlags;
use sideway::ibverbs::memory_region::MemoryRegion;

use super::VerbsOptions;
use super::device::{self, Device, Slab};
use crate::config::Config;
use crate::error::{Error, Result};
use crate::link::Registration;
use crate::pool::{Pool, PoolBufMut};

/// Size of one local slab: [`crate::config::VERBS_SLAB`], beside the memory limit that
/// must hold one.
pub(crate) use crate::config::VERBS_SLAB as SLAB;
/// Cached registrations kept at most, whatever their size (each costs the device an MR).
const CACHE_ENTRIES: usize = 1024;
/// How often the domain thread wakes without an event (trimming, stop checks).
const TICK: Duration = Duration::from_millis(250);
/// A slab free for this many ticks in a row (about 10 s) is deregistered (one free slab is
/// always kept). Long enough that memory a training step frees and takes again a step
/// later (pull snapshots, read destinations) stays registered from step to step, even at
/// the seconds per step of an emulated device.
const IDLE_TICKS: u32 = 40;

/// A cached registration's key: the exact range, `(address, length)`.
pub(crate) type CacheKey = (usize, usize);

/// Process-wide counters of one domain ([`super::registration_stats`]).
#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub reg_calls: AtomicU64,
    pub hits: AtomicU64,
    pub misses: AtomicU64,
    pub evictions: AtomicU64,
    pub inline_registrations: AtomicU64,
}

/// A snapshot of what a process holds registered on one device, and how its registration
/// cache does. From [`crate::verbs::registration_stats`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RegStats {
    /// The device (and port/GID choice) this domain covers.
    pub device: String,
    /// `ibv_reg_mr` calls so far (slabs, the user pool, cache misses).
    pub registrations: u64,
    /// Exposures of memory already registered (cache hits, user-pool buffers).
    pub cache_hits: u64,
    /// Exposures that had to register.
    pub cache_misses: u64,
    /// Cached registrations dropped to stay within `Config::reg_cache_size`.
    pub cache_evictions: u64,
    /// Registrations on a runtime thread because no registered memory was ready (the domain
    /// thread normally registers ahead of need).
    pub inline_registrations: u64,
    /// Bytes of local slabs registered now, and how many slabs.
    pub slab_bytes: usize,
    /// Number of local slabs.
    pub slabs: usize,
    /// Bytes of peer-readable slabs (`Link::alloc`), and how many slabs.
    pub exposable_bytes: usize,
    /// Number of peer-readable slabs.
    pub exposable_slabs: usize,
    /// Bytes of the user pool (0 until something asks for it).
    pub user_pool_bytes: usize,
    /// Bytes and entries in the registration cache (in use or idle).
    pub cache_bytes: usize,
    /// Entries in the registration cache.
    pub cache_entries: usize,
    /// What rdma-core said about fork safety (`ibv_is_fork_initialized`).
    pub fork: &'static str,
}

impl RegStats {
    /// Hits over all exposures that needed registered memory, or `None` before the first.
    pub fn hit_rate(&self) -> Option<f64> {
        let all = self.cache_hits + self.cache_misses;
        (all > 0).then(|| self.cache_hits as f64 / all as f64)
    }
}

static DOMAINS: Mutex<Vec<(String, Arc<Domain>)>> = Mutex::new(Vec::new());

/// The domain for `opts`, opened (device, protection domain, thread) on first use.
pub(crate) fn get(opts: &VerbsOptions, config: &Config) -> Result<Arc<Domain>> {
    let key = format!("{:?}/{:?}/{:?}", opts.device, opts.port, opts.gid_index);
    let mut all = DOMAINS.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, d)) = all.iter().find(|(k, _)| *k == key) {
        return Ok(d.clone());
    }
    let d = Domain::open(opts, config)?;
    all.push((key, d.clone()));
    Ok(d)
}

/// Snapshots of every domain this process opened.
pub(crate) fn all_stats() -> Vec<RegStats> {
    let all = DOMAINS.lock().unwrap_or_else(|e| e.into_inner());
    all.iter().map(|(_, d)| d.stats()).collect()
}

/// Per queue pair: a fatal event waiting for its link, and the link's waker.
#[derive(Default)]
struct QpSlot {
    fatal: Option<Error>,
    waker: Option<Waker>,
}

/// See the module docs.
pub(crate) struct Domain {
    pub dev: Device,
    pub local: SlabSet,
    /// Slabs readable by peers, for buffers the application allocates in order to expose
    /// them (`Link::alloc`): exposed with no registration, grown and trimmed like `local`.
    exposable: SlabSet,
    cache: Mutex<RegCache>,
    user_pool: OnceLock<Option<UserPool>>,
    user_pool_size: usize,
    qps: Mutex<HashMap<usize, QpSlot>>,
    device_fatal: Mutex<Option<Error>>,
    /// Wakes the domain thread (eventfd): a slab is wanted, or something to drop.
    wake_fd: RawFd,
    /// Bytes of slab the thread should add (0: none wanted).
    grow_wanted: Mutex<usize>,
    /// Deregistrations (evicted cache entries) for the thread to run off the data path.
    graveyard: Mutex<Vec<Box<dyn Send>>>,
    pub counters: Counters,
    fork: &'static str,
}

struct UserPool {
    pool: Arc<Pool>,
    rkey: u32,
    lkey: u32,
}

impl Domain {
    fn open(opts: &VerbsOptions, config: &Config) -> Result<Arc<Domain>> {
        let fork = device::fork_init();
        let dev = device::open(opts)?;
        // SAFETY: eventfd takes no pointers; the fd is ours and lives as long as the domain
        // (the process).
        let wake_fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if wake_fd < 0 {
            return Err(Error::io(
                "creating the verbs domain's eventfd",
                std::io::Error::last_os_error(),
            ));
        }
        // SAFETY: reading a field of the live context rdma-core gave us.
        let async_fd = unsafe { (*dev.ctx.context().as_ptr()).async_fd };
        // SAFETY: fcntl on the context's fd, which rdma-core keeps open; only flags change.
        unsafe {
            let fl = libc::fcntl(async_fd, libc::F_GETFL);
            if fl >= 0 {
                libc::fcntl(async_fd, libc::F_SETFL, fl | libc::O_NONBLOCK);
            }
        }
        let local = SlabSet::new(
            &dev,
            config.verbs_mem_limit,
            "registered memory of this process on the device (Config::verbs_mem_limit, IBEX_VERBS_MEM_LIMIT): raise it, or lower Config::credits/slot_size or the messages in flight",
            AccessFlags::LocalWrite,
        );
        // The bound that used to be the one-piece user pool's size.
        let exposable = SlabSet::new(
            &dev,
            config.pool_size,
            "peer-readable registered memory of this process on the device (Config::pool_size, IBEX_POOL_SIZE): raise it, or hold fewer exposed buffers at once",
            AccessFlags::LocalWrite | AccessFlags::RemoteRead,
        );
        let name = dev.name.clone();
        let d = Arc::new(Domain {
            dev,
            local,
            exposable,
            cache: Mutex::new(RegCache {
                map: HashMap::new(),
                lru: BTreeMap::new(),
                tick: 0,
                idle_bytes: 0,
                bytes: 0,
                limit: config.reg_cache_size,
            }),
            user_pool: OnceLock::new(),
            user_pool_size: config.pool_size,
            qps: Mutex::new(HashMap::new()),
            device_fatal: Mutex::new(None),
            wake_fd,
            grow_wanted: Mutex::new(0),
            graveyard: Mutex::new(Vec::new()),
            counters: Counters::default(),
            fork,
        });
        let t = d.clone();
        std::thread::Builder::new()
            .name(format!("ibex-verbs-{name}"))
            .spawn(move || t.run(async_fd))
            .map_err(|e| Error::io("starting the verbs domain thread", e))?;
        tracing::debug!(device = %name, fork, "verbs: domain opened");
        Ok(d)
    }

    pub fn stats(&self) -> RegStats {
        let (slab_bytes, slabs) = self.local.size();
        let (exposable_bytes, exposable_slabs) = self.exposable.size();
        let (cache_bytes, cache_entries) = {
            let c = self.cache.lock().unwrap_or_else(|e| e.into_inner());
            (c.bytes, c.map.len())
        };
        let c = &self.counters;
        RegStats {
            device: format!("{:?}", self.dev),
            registrations: c.reg_calls.load(Ordering::Relaxed),
            cache_hits: c.hits.load(Ordering::Relaxed),
            cache_misses: c.misses.load(Ordering::Relaxed),
            cache_evictions: c.evictions.load(Ordering::Relaxed),
            inline_registrations: c.inline_registrations.load(Ordering::Relaxed),
            slab_bytes,
            slabs,
            exposable_bytes,
            exposable_slabs,
            user_pool_bytes: self
                .user_pool
                .get()
                .and_then(|p| p.as_ref())
                .map_or(0, |p| p.pool.size()),
            cache_bytes,
            cache_entries,
            fork: self.fork,
        }
    }

    fn wake_thread(&self) {
        let one: u64 = 1;
        // SAFETY: writes 8 bytes from a live u64 to our eventfd; a full counter (EAGAIN) only
        // means the thread is already due to wake.
        unsafe { libc::write(self.wake_fd, (&one as *const u64).cast(), 8) };
    }

    /// Asks the domain thread for `bytes` more of local slab (no wait).
    pub fn request_growth(&self, bytes: usize) {
        {
            let mut g = self.grow_wanted.lock().unwrap_or_else(|e| e.into_inner());
            *g = (*g).max(bytes);
        }
        self.wake_thread();
    }

    /// Local memory for `len` bytes if a slab has room now; asks the thread for more when
    /// free space runs low. Never registers.
    pub fn try_local(&self, len: usize) -> Option<(PoolBufMut, u32)> {
        let (got, free) = self.local.try_alloc(len);
        if free < SLAB.max(len) {
            self.request_growth(len.max(SLAB));
        }
        got
    }

    /// Local memory for `len` bytes, registering a slab now if none has room. Blocks: call
    /// it at set-up (off the runtime) or as the rare fallback, which is counted.
    pub fn local_or_register(&self, len: usize, inline: bool) -> Result<(PoolBufMut, u32)> {
        if let Some(b) = self.try_local(len) {
            return Ok(b);
        }
        if inline {
            self.counters
                .inline_registrations
                .fetch_add(1, Ordering::Relaxed);
            tracing::debug!(
                len,
                "verbs: no registered memory ready; registering on the data path"
            );
        }
        self.local.grow(len, &self.counters)?;
        self.local.try_alloc(len).0.ok_or_else(|| {
            Error::Config(format!(
                "registered memory for {len} bytes was taken by other connections at once; Config::verbs_mem_limit (IBEX_VERBS_MEM_LIMIT) bounds it"
            ))
        })
    }

    /// Peer-readable memory for `len` bytes if a slab has room now. Never registers.
    pub fn try_exposable(&self, len: usize) -> Option<PoolBufMut> {
        self.exposable.try_alloc(len).0.map(|(b, _)| b)
    }

    /// Peer-readable memory for `len` bytes: exposing it registers nothing. Takes room in a
    /// slab, registering one that fits when none has room (blocks then: call it off the
    /// runtime, or accept a one-time stall for long-lived buffers).
    pub fn alloc_exposable(&self, len: usize) -> Result<PoolBufMut> {
        if let Some(b) = self.try_exposable(len) {
            return Ok(b);
        }
        self.exposable.grow(len, &self.counters)?;
        match self.exposable.try_alloc(len) {
            (Some((b, _)), _) => Ok(b),
            (None, _) => Err(Error::Config(format!(
                "peer-readable memory for {len} bytes was taken by other connections at once; Config::pool_size (IBEX_POOL_SIZE) bounds it"
            ))),
        }
    }

    /// The local key for `ptr..ptr+len` if this domain registered it for local writes.
    pub fn lkey_for(&self, ptr: *const u8, len: usize) -> Option<u32> {
        if let Some(Some(p)) = self.user_pool.get()
            && p.pool.offset_of(ptr, len).is_some()
        {
            return Some(p.lkey);
        }
        self.local
            .lkey_for(ptr, len)
            .or_else(|| self.exposable.keys_for(ptr, len).map(|k| k.0))
    }

    /// The user pool, registered on first call (blocks for the registration then).
    pub fn user_pool(&self) -> Option<Arc<Pool>> {
        self.user_pool
            .get_or_init(|| {
                let slab = Slab::new(
                    &self.dev.pd,
                    self.user_pool_size,
                    AccessFlags::LocalWrite | AccessFlags::RemoteRead,
                );
                self.counters.reg_calls.fetch_add(1, Ordering::Relaxed);
                match slab {
                    Ok(mut slab) => {
                        let (lkey, rkey, base, len) =
                            (slab.lkey(), slab.rkey(), slab.base(), slab.len());
                        // SAFETY: the slab owns the memory, keeps it registered and never
                        // touches it itself; the pool becomes its only user.
                        let pool = unsafe { Pool::from_raw(base, len, Box::new(slab)) };
                        Some(UserPool { pool, rkey, lkey })
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "verbs: no registered pool (Config::pool_size); exposures register per buffer");
                        None
                    }
                }
            })
            .as_ref()
            .map(|p| p.pool.clone())
    }

    /// True when exposing `buf` would register memory now.
    pub fn would_register(&self, buf: &[u8]) -> bool {
        if buf.is_empty() {
            return false;
        }
        if let Some(Some(p)) = self.user_pool.get()
            && p.pool.offset_of(buf.as_ptr(), buf.len()).is_some()
        {
            return false;
        }
        if self.exposable.keys_for(buf.as_ptr(), buf.len()).is_some() {
            return false;
        }
        let c = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        !c.map.contains_key(&(buf.as_ptr() as usize, buf.len()))
    }

    /// Registers `buf` into the cache ahead of its exposure (blocks; run it off the runtime).
    /// The exposure that finds it still counts it as a miss.
    pub fn prepare(&self, buf: &Bytes) -> Result<()> {
        if !self.would_register(buf) {
            return Ok(());
        }
        let mr = self.register_remote(buf)?;
        let mut c = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        let key = (buf.as_ptr() as usize, buf.len());
        if c.map.contains_key(&key) {
            // Someone else registered it meanwhile; ours is dropped.
            drop(c);
            self.bury(Box::new(mr));
            return Ok(());
        }
        let rkey = mr.rkey();
        c.insert(key, mr, rkey, buf.clone(), 0, true);
        let evicted = c.evict();
        drop(c);
        self.evicted(evicted);
        Ok(())
    }

    fn register_remote(&self, buf: &Bytes) -> Result<Arc<MemoryRegion>> {
        self.counters.reg_calls.fetch_add(1, Ordering::Relaxed);
        // SAFETY: the region is kept together with a clone of `buf` (cache entry), so the
        // memory stays allocated, mapped and unchanged (Bytes are immutable) while it is
        // registered; a region that loses a race is dropped before that clone.
        unsafe {
            device::register(
                &self.dev.pd,
                buf.as_ptr(),
                buf.len(),
                AccessFlags::RemoteRead,
            )
        }
    }

    /// The rkey to expose `buf` with, the cache key to release on withdraw, and how it was
    /// found. Registers inline only when nothing prepared it (direct `Link` users).
    pub fn expose(&self, buf: &Bytes) -> Result<(u32, Option<CacheKey>, Registration)> {
        let (ptr, len) = (buf.as_ptr() as usize, buf.len());
        if len == 0 {
            return Ok((0, None, Registration::NotNeeded));
        }
        if let Some(Some(p)) = self.user_pool.get()
            && p.pool.offset_of(buf.as_ptr(), len).is_some()
        {
            self.counters.hits.fetch_add(1, Ordering::Relaxed);
            return Ok((p.rkey, None, Registration::Pool));
        }
        if let Some((_, rkey)) = self.exposable.keys_for(buf.as_ptr(), len) {
            self.counters.hits.fetch_add(1, Ordering::Relaxed);
            return Ok((rkey, None, Registration::Pool));
        }
        let key = (ptr, len);
        {
            let mut c = self.cache.lock().unwrap_or_else(|e| e.into_inner());
            if let Some((rkey, fresh)) = c.take(key) {
                let (counter, how) = if fresh {
                    (&self.counters.misses, Registration::Registered)
                } else {
                    (&self.counters.hits, Registration::CacheHit)
                };
                counter.fetch_add(1, Ordering::Relaxed);
                return Ok((rkey, Some(key), how));
            }
        }
        let mr = self.register_remote(buf)?;
        self.counters.misses.fetch_add(1, Ordering::Relaxed);
        let rkey = mr.rkey();
        let mut c = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((rkey, _)) = c.take(key) {
            drop(c);
            self.bury(Box::new(mr));
            return Ok((rkey, Some(key), Registration::Registered));
        }
        c.insert(key, mr, rkey, buf.clone(), 1, false);
        let evicted = c.evict();
        drop(c);
        self.evicted(evicted);
        Ok((rkey, Some(key), Registration::Registered))
    }

    /// An exposure of `key` was withdrawn: the entry stays cached, idle once unused.
    pub fn release(&self, key: (usize, usize)) {
        let mut c = self.cache.lock().unwrap_or_else(|e| e.into_inner());
        c.release(key);
        let evicted = c.evict();
        drop(c);
        self.evicted(evicted);
    }

    /// Drops the idle cache entry for `key` now (deregistering on this thread), so that the
    /// buffer it holds goes back to its owner.
    pub fn forget(&self, key: (usize, usize)) {
        let e = self
            .cache
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove_idle(key);
        drop(e);
    }

    fn evicted(&self, v: Vec<CacheEntry<Arc<MemoryRegion>>>) {
        if v.is_empty() {
            return;
        }
        self.counters
            .evictions
            .fetch_add(v.len() as u64, Ordering::Relaxed);
        // Deregistering is a syscall that unpins pages: the thread does it, off the data path.
        self.bury(Box::new(v));
    }

    fn bury(&self, b: Box<dyn Send>) {
        self.graveyard
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(b);
        self.wake_thread();
    }

    /// Starts delivering `qp`'s asynchronous events to [`Domain::poll_qp`].
    pub fn watch_qp(&self, qp: usize) {
        self.qps
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .insert(qp, QpSlot::default());
    }

    /// Stops it (the queue pair is being destroyed; its address may be reused).
    pub fn unwatch_qp(&self, qp: usize) {
        self.qps
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&qp);
    }

    /// A fatal event for `qp` (or the device), if one came; registers `cx` for the next.
    pub fn poll_qp(&self, cx: &mut Context<'_>, qp: usize) -> Option<Error> {
        if let Some(e) = self
            .device_fatal
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
        {
            return Some(e);
        }
        let mut qps = self.qps.lock().unwrap_or_else(|e| e.into_inner());
        let slot = qps.entry(qp).or_default();
        if let Some(e) = slot.fatal.take() {
            return Some(e);
        }
        if !slot.waker.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
            slot.waker = Some(cx.waker().clone());
        }
        None
    }

    /// The domain thread: device events, slab growth and trimming, deferred deregistration.
    fn run(self: Arc<Domain>, async_fd: RawFd) {
        loop {
            let mut fds = [
                libc::pollfd {
                    fd: async_fd,
                    events: libc::POLLIN,
                    revents: 0,
                },
                libc::pollfd {
                    fd: self.wake_fd,
                    events: libc::POLLIN,
                    revents: 0,
                },
            ];
            // SAFETY: `fds` is a live array of two pollfd structs.
            let rc = unsafe { libc::poll(fds.as_mut_ptr(), 2, TICK.as_millis() as i32) };
            if rc > 0 && fds[1].revents != 0 {
                let mut v = 0u64;
                // SAFETY: reads 8 bytes into a live u64 from our non-blocking eventfd.
                unsafe { libc::read(self.wake_fd, (&mut v as *mut u64).cast(), 8) };
            }
            if rc > 0 && fds[0].revents != 0 {
                self.read_events();
            }
            let want =
                std::mem::take(&mut *self.grow_wanted.lock().unwrap_or_else(|e| e.into_inner()));
            if want > 0
                && self.local.free_bytes() < want
                && let Err(e) = self.local.grow(want, &self.counters)
            {
                tracing::debug!(error = %e, "verbs: could not add a slab ahead of need");
            }
            let dead =
                std::mem::take(&mut *self.graveyard.lock().unwrap_or_else(|e| e.into_inner()));
            drop(dead);
            if rc == 0 {
                self.local.trim();
                self.exposable.trim();
            }
        }
    }

    fn read_events(&self) {
        loop {
            let mut ev = std::mem::MaybeUninit::<sys::ibv_async_event>::zeroed();
            // SAFETY: the context is live (the domain holds it), its async fd is non-blocking,
            // and `ev` is ours.
            let rc = unsafe {
                sys::ibv_get_async_event(self.dev.ctx.context().as_ptr(), ev.as_mut_ptr())
            };
            if rc != 0 {
                return;
            }
            // Read the type as a plain integer: a provider may report values newer than the
            // bindings' enum knows.
            // SAFETY: the call filled `ev`; `event_type` is a 4-byte field at this offset.
            let kind = unsafe {
                ev.as_ptr()
                    .cast::<u8>()
                    .add(std::mem::offset_of!(sys::ibv_async_event, event_type))
                    .cast::<u32>()
                    .read()
            };
            // SAFETY: the union's first word is the object pointer for QP events.
            let obj = unsafe { ev.as_ptr().cast::<*mut std::ffi::c_void>().read() } as usize;
            // SAFETY: acknowledging the event we just got, once.
            unsafe { sys::ibv_ack_async_event(ev.as_mut_ptr()) };
            const QP_FATAL: u32 = 1;
            const QP_REQ_ERR: u32 = 2;
            const QP_ACCESS_ERR: u32 = 3;
            const DEVICE_FATAL: u32 = 8;
            const PORT_ERR: u32 = 10;
            match kind {
                QP_FATAL | QP_REQ_ERR | QP_ACCESS_ERR => {
                    let mut qps = self.qps.lock().unwrap_or_else(|e| e.into_inner());
                    if let Some(slot) = qps.get_mut(&obj) {
                        slot.fatal = Some(Error::PeerGone(format!(
                            "the RDMA queue pair failed (async event {kind}: the peer sent an invalid request or the path broke)"
                        )));
                        if let Some(w) = slot.waker.take() {
                            w.wake();
                        }
                    }
                }
                DEVICE_FATAL => {
                    *self.device_fatal.lock().unwrap_or_else(|e| e.into_inner()) =
                        Some(Error::PeerGone(
                            "the RDMA device reported a fatal error (async event DEVICE_FATAL)"
                                .into(),
                        ));
                    let mut qps = self.qps.lock().unwrap_or_else(|e| e.into_inner());
                    for slot in qps.values_mut() {
                        if let Some(w) = slot.waker.take() {
                            w.wake();
                        }
                    }
                }
                PORT_ERR => tracing::warn!(
                    "RDMA port went down (async event PORT_ERR); waiting for it to recover"
                ),
                other => tracing::debug!(event = other, "RDMA async event"),
            }
        }
    }
}

/// One registered slab of local memory.
struct RegSlab {
    pool: Arc<Pool>,
    lkey: u32,
    rkey: u32,
    /// Ticks in a row the slab was found entirely free.
    idle: u32,
}

/// Local slabs registered on demand. See the module docs.
pub(crate) struct SlabSet {
    pd: Arc<sideway::ibverbs::protection_domain::ProtectionDomain>,
    limit: usize,
    /// The setting that bounds this set, for the error past it.
    bound_by: &'static str,
    access: AccessFlags,
    slabs: Mutex<Vec<RegSlab>>,
    /// Bytes being registered right now (counted against the limit).
    registering: Mutex<usize>,
}

impl SlabSet {
    fn new(dev: &Device, limit: usize, bound_by: &'static str, access: AccessFlags) -> SlabSet {
        SlabSet {
            pd: dev.pd.clone(),
            limit,
            bound_by,
            access,
            slabs: Mutex::new(Vec::new()),
            registering: Mutex::new(0),
        }
    }

    /// A buffer if some slab has room, and the free bytes left across all slabs.
    fn try_alloc(&self, len: usize) -> (Option<(PoolBufMut, u32)>, usize) {
        let slabs = self.slabs.lock().unwrap_or_else(|e| e.into_inner());
        let mut got = None;
        let mut free = 0;
        for s in slabs.iter() {
            if got.is_none()
                && let Ok(b) = s.pool.alloc(len)
            {
                got = Some((b, s.lkey));
            }
            free += s.pool.free_bytes();
        }
        (got, free)
    }

    pub(crate) fn free_bytes(&self) -> usize {
        let slabs = self.slabs.lock().unwrap_or_else(|e| e.into_inner());
        slabs.iter().map(|s| s.pool.free_bytes()).sum()
    }

    fn size(&self) -> (usize, usize) {
        let slabs = self.slabs.lock().unwrap_or_else(|e| e.into_inner());
        (slabs.iter().map(|s| s.pool.size()).sum(), slabs.len())
    }

    fn lkey_for(&self, ptr: *const u8, len: usize) -> Option<u32> {
        self.keys_for(ptr, len).map(|k| k.0)
    }

    /// The (local, remote) keys of the slab holding `ptr..ptr+len`.
    fn keys_for(&self, ptr: *const u8, len: usize) -> Option<(u32, u32)> {
        let slabs = self.slabs.lock().unwrap_or_else(|e| e.into_inner());
        slabs
            .iter()
            .find(|s| s.pool.offset_of(ptr, len).is_some())
            .map(|s| (s.lkey, s.rkey))
    }

    /// Registers one more slab that fits `len` (blocks while registering).
    fn grow(&self, len: usize, counters: &Counters) -> Result<()> {
        let size = len.max(SLAB).div_ceil(SLAB) * SLAB;
        {
            let (have, _) = self.size();
            let mut reg = self.registering.lock().unwrap_or_else(|e| e.into_inner());
            if have + *reg + size > self.limit {
                return Err(Error::TooLarge {
                    len: (have + *reg + size) as u64,
                    limit: self.limit as u64,
                    which: self.bound_by,
                });
            }
            *reg += size;
        }
        counters.reg_calls.fetch_add(1, Ordering::Relaxed);
        let slab = Slab::new(&self.pd, size, self.access);
        *self.registering.lock().unwrap_or_else(|e| e.into_inner()) -= size;
        let mut slab = slab?;
        let (lkey, rkey, base, len) = (slab.lkey(), slab.rkey(), slab.base(), slab.len());
        // SAFETY: the slab owns the memory and its registration, never touches the memory
        // itself, and lives as long as the pool (its owner).
        let pool = unsafe { Pool::from_raw(base, len, Box::new(slab)) };
        self.slabs
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(RegSlab {
                pool,
                lkey,
                rkey,
                idle: 0,
            });
        Ok(())
    }

    /// Deregisters slabs that stayed entirely free for a while, keeping one.
    fn trim(&self) {
        let mut dropped = Vec::new();
        {
            let mut slabs = self.slabs.lock().unwrap_or_else(|e| e.into_inner());
            let mut kept_free = false;
            let mut i = 0;
            while i < slabs.len() {
                let s = &mut slabs[i];
                // Entirely free means no buffer holds it: every buffer keeps an `Arc` and
                // gives its range back on drop, so a free slab has no user and, under this
                // lock, cannot get one.
                if s.pool.free_bytes() >= s.pool.size() & !63 {
                    s.idle += 1;
                    if !kept_free {
                        kept_free = true;
                    } else if s.idle >= IDLE_TICKS {
                        dropped.push(slabs.swap_remove(i));
                        continue;
                    }
                } else {
                    s.idle = 0;
                }
                i += 1;
            }
        }
        drop(dropped);
    }
}

struct CacheEntry<R> {
    // Dropped (deregistered) before `_buf`, so the memory outlives its registration.
    _reg: R,
    rkey: u32,
    _buf: Bytes,
    len: usize,
    /// Live exposures using it.
    users: usize,
    /// Registered by `prepare` and not yet found by an exposure (that one counts a miss).
    fresh: bool,
    /// Position in the LRU while idle.
    tick: u64,
}

/// The registration cache. See the module docs.
pub(crate) struct RegCache<R = Arc<MemoryRegion>> {
    map: HashMap<(usize, usize), CacheEntry<R>>,
    /// Idle entries by last use, oldest first.
    lru: BTreeMap<u64, (usize, usize)>,
    tick: u64,
    idle_bytes: usize,
    bytes: usize,
    limit: usize,
}

impl<R> RegCache<R> {
    /// A hit: the entry gains a user. Returns its rkey and whether `prepare` made it.
    fn take(&mut self, key: (usize, usize)) -> Option<(u32, bool)> {
        let e = self.map.get_mut(&key)?;
        if e.users == 0 {
            self.lru.remove(&e.tick);
            self.idle_bytes -= e.len;
        }
        e.users += 1;
        let fresh = std::mem::take(&mut e.fresh);
        Some((e.rkey, fresh))
    }

    fn insert(
        &mut self,
        key: (usize, usize),
        reg: R,
        rkey: u32,
        buf: Bytes,
        users: usize,
        fresh: bool,
    ) {
        self.tick += 1;
        let e = CacheEntry {
            _reg: reg,
            rkey,
            _buf: buf,
            len: key.1,
            users,
            fresh,
            tick: self.tick,
        };
        if users == 0 {
            self.lru.insert(self.tick, key);
            self.idle_bytes += key.1;
        }
        self.bytes += key.1;
        self.map.insert(key, e);
    }

    fn release(&mut self, key: (usize, usize)) {
        let Some(e) = self.map.get_mut(&key) else {
            return;
        };
        e.users = e.users.saturating_sub(1);
        if e.users == 0 {
            self.tick += 1;
            e.tick = self.tick;
            self.lru.insert(self.tick, key);
            self.idle_bytes += e.len;
        }
    }

    /// Takes out `key`'s entry if no exposure uses it.
    fn remove_idle(&mut self, key: (usize, usize)) -> Option<CacheEntry<R>> {
        if self.map.get(&key)?.users > 0 {
            return None;
        }
        let e = self.map.remove(&key)?;
        self.lru.remove(&e.tick);
        self.idle_bytes -= e.len;
        self.bytes -= e.len;
        Some(e)
    }

    /// Drops idle entries, oldest first, while over the byte or entry bound.
    fn evict(&mut self) -> Vec<CacheEntry<R>> {
        let mut out = Vec::new();
        while self.idle_bytes > self.limit || self.map.len() > CACHE_ENTRIES {
            let Some((_, key)) = self.lru.pop_first() else {
                break;
            };
            if let Some(e) = self.map.remove(&key) {
                self.idle_bytes -= e.len;
                self.bytes -= e.len;
                out.push(e);
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cache(limit: usize) -> RegCache<()> {
        RegCache {
            map: HashMap::new(),
            lru: BTreeMap::new(),
            tick: 0,
            idle_bytes: 0,
            bytes: 0,
            limit,
        }
    }

    fn key(b: &Bytes) -> (usize, usize) {
        (b.as_ptr() as usize, b.len())
    }

    #[test]
    fn registrations_outlive_their_exposure_and_hit_again() {
        let mut c = cache(1 << 20);
        let b = Bytes::from(vec![1u8; 4096]);
        c.insert(key(&b), (), 7, b.clone(), 1, false);
        c.release(key(&b));
        assert!(c.evict().is_empty(), "idle but within the bound: kept");
        assert_eq!(
            c.take(key(&b)),
            Some((7, false)),
            "a hit after the last withdraw"
        );
        assert_eq!(c.idle_bytes, 0);
    }

    #[test]
    fn idle_entries_are_evicted_oldest_first_past_the_bound_and_in_use_ones_never() {
        let mut c = cache(8192);
        let bufs: Vec<Bytes> = (0..4).map(|i| Bytes::from(vec![i as u8; 4096])).collect();
        for (i, b) in bufs.iter().enumerate() {
            c.insert(key(b), (), i as u32, b.clone(), 1, false);
        }
        // 0 stays in use; 1, 2, 3 go idle in that order.
        for b in &bufs[1..] {
            c.release(key(b));
        }
        let out = c.evict();
        assert_eq!(out.len(), 1);
        assert_eq!(
            out[0].rkey, 1,
            "the least recently used idle entry goes first"
        );
        assert_eq!(c.idle_bytes, 8192);
        assert!(c.take(key(&bufs[0])).is_some(), "in use: never evicted");
        assert!(c.take(key(&bufs[1])).is_none());
    }

    #[test]
    fn a_prepared_entry_counts_once_as_registered() {
        let mut c = cache(1 << 20);
        let b = Bytes::from(vec![0u8; 100]);
        c.insert(key(&b), (), 3, b.clone(), 0, true);
        assert_eq!(c.take(key(&b)), Some((3, true)));
        c.release(key(&b));
        assert_eq!(c.take(key(&b)), Some((3, false)));
        assert!(c.remove_idle(key(&b)).is_none(), "in use: stays");
        c.release(key(&b));
        assert!(c.remove_idle(key(&b)).is_some(), "idle: goes on request");
        assert_eq!((c.bytes, c.idle_bytes, c.lru.len()), (0, 0, 0));
    }

    #[test]
    fn the_cache_holds_the_memory_it_registered() {
        // While cached, the buffer cannot be freed: a new buffer at the same address is
        // impossible, so a hit never names stale memory.
        let mut c = cache(1 << 20);
        let b = Bytes::from(vec![5u8; 64]);
        let k = key(&b);
        c.insert(k, (), 1, b, 0, false);
        let e = c.map.get(&k).expect("cached");
        assert_eq!(e._buf.as_ptr() as usize, k.0);
        assert_eq!(e._buf[0], 5);
    }
}
