//! Pull replies as descriptors: the snapshots of variables a shard has exposed to workers
//! for one-sided reads, and when it lets them go.
//!
//! A snapshot is the pooled buffer `Shard::read` copied the variable into under its lock,
//! so it holds exactly the answered step; nothing writes it while it is exposed, and it
//! returns to the pool only when its lease ends. A lease ends when the worker names it in
//! the `release` field of a later request on the same connection (it does so once it has
//! read the bytes), or when it is older than the timeout (a worker that never reads). Each
//! connection holds at most `max_leases` leases and `max_bytes` bytes; past either, replies
//! go inline, so a worker that never releases costs the shard a bounded amount of memory.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use ibex_transport::grpc::RemoteBuf;

/// Bounds on what one connection's unreleased pull replies may hold.
#[derive(Clone, Copy, Debug)]
pub struct ExposeLimits {
    /// Leases (exposed tensors) per connection. A ResNet-50 step pulls about 80 parts
    /// from each of 2 shards; the default leaves room for many steps in flight.
    pub max_leases: usize,
    /// Exposed bytes per connection.
    pub max_bytes: u64,
    /// How long a lease lives when the worker never releases it.
    pub timeout: Duration,
}

impl Default for ExposeLimits {
    fn default() -> Self {
        ExposeLimits {
            max_leases: 1024,
            max_bytes: 2 << 30,
            timeout: Duration::from_secs(30),
        }
    }
}

struct Lease {
    conn: u64,
    bytes: u64,
    expires: Instant,
    /// `None` between reserving and exposing; dropping it withdraws the exposure, and the
    /// transport then drops its `Bytes`, which returns the snapshot buffer to the pool.
    remote: Option<RemoteBuf>,
}

#[derive(Default)]
struct Inner {
    next: u64,
    leases: HashMap<u64, Lease>,
    /// Per connection: leases and bytes held.
    held: HashMap<u64, (usize, u64)>,
}

impl Inner {
    fn remove(&mut self, id: u64) -> Option<Lease> {
        let l = self.leases.remove(&id)?;
        if let Some(h) = self.held.get_mut(&l.conn) {
            h.0 -= 1;
            h.1 -= l.bytes;
            if h.0 == 0 {
                self.held.remove(&l.conn);
            }
        }
        Some(l)
    }
}

/// The shard's exposed pull replies, over all connections.
pub(crate) struct Exposures {
    inner: Mutex<Inner>,
    limits: ExposeLimits,
    sweeper: AtomicBool,
}

impl Exposures {
    pub(crate) fn new(limits: ExposeLimits) -> Arc<Exposures> {
        Arc::new(Exposures {
            inner: Mutex::new(Inner::default()),
            limits,
            sweeper: AtomicBool::new(false),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // Every update is complete before the guard drops: a panic cannot leave it torn.
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// A lease for `bytes` on connection `conn`, or `None` when the connection holds its
    /// limit (the reply then goes inline). Starts the timeout sweeper on first use.
    pub(crate) fn reserve(self: &Arc<Self>, conn: u64, bytes: u64) -> Option<u64> {
        let id = {
            let mut g = self.lock();
            let (n, b) = g.held.get(&conn).copied().unwrap_or((0, 0));
            if n >= self.limits.max_leases || b.saturating_add(bytes) > self.limits.max_bytes {
                return None;
            }
            g.held.insert(conn, (n + 1, b + bytes));
            // Lease ids start at 1: 0 means "no lease" on the wire.
            g.next += 1;
            let id = g.next;
            g.leases.insert(
                id,
                Lease {
                    conn,
                    bytes,
                    expires: Instant::now() + self.limits.timeout,
                    remote: None,
                },
            );
            id
        };
        if !self.sweeper.swap(true, Ordering::Relaxed) {
            tokio::spawn(sweep(Arc::downgrade(self), self.limits.timeout));
        }
        Some(id)
    }

    /// Hands the exposure of lease `id` over; it lives until the lease ends.
    pub(crate) fn attach(&self, id: u64, remote: RemoteBuf) {
        let mut g = self.lock();
        match g.leases.get_mut(&id) {
            Some(l) => l.remote = Some(remote),
            // Cannot happen (the worker has not seen the id yet), but if the lease is gone
            // the exposure goes too.
            None => drop(remote),
        }
    }

    /// Ends lease `id` without it having been used (exposing failed).
    pub(crate) fn cancel(&self, id: u64) {
        let l = self.lock().remove(id);
        drop(l);
    }

    /// Ends the leases `ids` that belong to connection `conn`; ids of other connections or
    /// unknown ids are ignored, so a worker can release only what it was given.
    pub(crate) fn release(&self, conn: u64, ids: &[u64]) {
        if ids.is_empty() {
            return;
        }
        let mut gone = Vec::new();
        {
            let mut g = self.lock();
            for &id in ids {
                if g.leases.get(&id).is_some_and(|l| l.conn == conn)
                    && let Some(l) = g.remove(id)
                {
                    gone.push(l);
                }
            }
        }
        // Withdrawn outside the lock: dropping a RemoteBuf talks to the connection.
        drop(gone);
    }

    /// Ends every lease past its timeout.
    fn expire(&self, now: Instant) {
        let gone: Vec<Lease> = {
            let mut g = self.lock();
            let ids: Vec<u64> = g
                .leases
                .iter()
                .filter(|(_, l)| l.expires <= now)
                .map(|(&id, _)| id)
                .collect();
            ids.into_iter().filter_map(|id| g.remove(id)).collect()
        };
        if !gone.is_empty() {
            tracing::debug!(
                leases = gone.len(),
                "pull replies never released by their worker expired"
            );
        }
    }

    /// Leases held now, over all connections.
    pub(crate) fn held(&self) -> usize {
        self.lock().leases.len()
    }
}

/// Expires old leases while the shard lives. One task per shard, so the check costs
/// nothing per request.
async fn sweep(ex: Weak<Exposures>, timeout: Duration) {
    let every = (timeout / 4).clamp(Duration::from_millis(10), Duration::from_secs(1));
    loop {
        tokio::time::sleep(every).await;
        match ex.upgrade() {
            Some(e) => e.expire(Instant::now()),
            None => return,
        }
    }
}
