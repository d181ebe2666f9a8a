//! The listener's acceptor: one task per listening socket takes raw streams off it and sets
//! each one up (provider preface, then the protocol handshake) in a task of its own, under
//! a deadline and a cap on set-ups in progress. Finished connections wait in a channel for
//! [`super::Listener::accept`], so a peer that stalls or sends junk costs only its own
//! slot, and `accept` only ever waits on a channel (cancel-safe).

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};
use tokio::task::{AbortHandle, JoinSet};

use super::Connection;
use crate::config::Config;
use crate::error::{Error, Result};
use crate::link::Link;

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

impl Raw {
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
            Raw::Tcp(s, peer) => Some(Box::new(crate::tcp::setup(s, config, peer).await?)),
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

/// One set-up's claim on a slot of `max_handshakes`. The acceptor can take the permit back
/// from a set-up still in progress (and abort it) to make room for a newcomer.
struct Slot {
    permit: Option<OwnedSemaphorePermit>,
    /// Still setting up: once the connection is made, only `accept` ends the claim.
    in_setup: bool,
    started: Instant,
    peer: String,
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

/// How long a set-up must have waited before a newcomer may take its slot: honest tcp and
/// shm set-ups finish in milliseconds, so a burst of honest peers never evicts its own,
/// while a flood of silent ones gives way within this.
fn eviction_age(config: &Config) -> Duration {
    (config.handshake_timeout / 10).min(Duration::from_millis(250))
}

/// Takes the slot of the longest-waiting set-up still in progress, if it has waited at
/// least `min_age`, and aborts that set-up (its peer's socket closes).
fn evict_oldest(
    pending: &mut VecDeque<SlotRef>,
    min_age: Duration,
) -> Option<(OwnedSemaphorePermit, String)> {
    pending.retain(|s| lock(s).permit.is_some());
    for s in pending.iter() {
        let mut g = lock(s);
        if !g.in_setup {
            continue;
        }
        // Oldest first: if this one is too young, so is every later one.
        if g.started.elapsed() < min_age {
            return None;
        }
        let permit = g.permit.take()?;
        if let Some(a) = g.abort.take() {
            a.abort();
        }
        return Some((permit, std::mem::take(&mut g.peer)));
    }
    None
}

/// Accepts from `source` until aborted (the listener's drop aborts it, and with it every
/// set-up it started). At the cap on set-ups, a newcomer takes the slot of the set-up that
/// has waited longest (past [`eviction_age`]): a flood of silent peers then only churns
/// among itself, and an honest peer still gets through. Only when every slot is young or
/// holds a made connection waiting for `accept` is the newcomer refused.
pub(super) async fn run(source: Source, shared: Arc<Shared>) {
    let provider = source.provider();
    let homes = if source.homed() {
        shared.config.serve_threads
    } else {
        0
    };
    let mut setups = JoinSet::new();
    let mut pending: VecDeque<SlotRef> = VecDeque::new();
    let min_age = eviction_age(&shared.config);
    let mut backoff = Duration::ZERO;
    loop {
        tokio::select! {
            r = source.accept() => match r {
                Ok(raw) => {
                    backoff = Duration::ZERO;
                    let permit = match shared.slots.clone().try_acquire_owned() {
                        Ok(p) => Ok(p),
                        Err(_) => match evict_oldest(&mut pending, min_age) {
                            Some((p, evicted)) => {
                                if let Some(held_back) = shared.warnings.allow() {
                                    tracing::warn!(
                                        peer = %evicted,
                                        limit = shared.config.max_handshakes,
                                        held_back,
                                        "closed the longest-waiting connection set-up to make room for a new peer: {} set-ups were in progress (Config::max_handshakes, IBEX_MAX_HANDSHAKES)",
                                        shared.config.max_handshakes
                                    )
                                }
                                Ok(p)
                            }
                            None => Err(()),
                        },
                    };
                    match permit {
                        Ok(permit) => {
                            let slot = Arc::new(std::sync::Mutex::new(Slot {
                                permit: Some(permit),
                                in_setup: true,
                                started: Instant::now(),
                                peer: raw.peer(),
                                abort: None,
                            }));
                            let fut = set_up(raw, shared.clone(), SlotGuard(slot.clone()));
                            // Set up on its home, so the link's wake-ups register with the
                            // runtime that will run the connection.
                            let abort = match super::home::next(homes) {
                                Some(h) => {
                                    setups.spawn_on(super::home::set_up_on(h.clone(), fut), &h)
                                }
                                None => setups.spawn(fut),
                            };
                            lock(&slot).abort = Some(abort);
                            pending.push_back(slot);
                            // Ended claims leave; at most a few times the cap stay listed.
                            while pending.front().is_some_and(|s| lock(s).permit.is_none()) {
                                pending.pop_front();
                            }
                            if pending.len() > 2 * shared.config.max_handshakes {
                                pending.retain(|s| lock(s).permit.is_some());
                            }
                        }
                        Err(()) => {
                            if let Some(held_back) = shared.warnings.allow() {
                                tracing::warn!(
                                    peer = %raw.peer(),
                                    limit = shared.config.max_handshakes,
                                    held_back,
                                    "refused a connection: {} set-ups are already in progress (Config::max_handshakes, IBEX_MAX_HANDSHAKES)",
                                    shared.config.max_handshakes
                                )
                            }
                        }
                    }
                }
                // Out of descriptors and the like: the socket itself is fine, so pause (the
                // pause keeps a lasting failure from spinning) and go on.
                Err(e) => {
                    backoff = (backoff * 2).clamp(Duration::from_millis(5), Duration::from_secs(1));
                    tracing::warn!(%e, provider, retry_in = ?backoff, "listener: accepting failed");
                    tokio::time::sleep(backoff).await;
                }
            },
            Some(_) = setups.join_next(), if !setups.is_empty() => {}
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
    let result = match tokio::time::timeout_at(deadline, raw.setup(config)).await {
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
            lock(&slot.0).in_setup = false;
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
