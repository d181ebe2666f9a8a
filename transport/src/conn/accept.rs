//! The listener's acceptor: one task per listening socket takes raw streams off it and sets
//! each one up (provider preface, then the protocol handshake) in a task of its own, under
//! a deadline and a cap on set-ups in progress. Finished connections wait in a channel for
//! [`super::Listener::accept`], so a peer that stalls or sends junk costs only its own
//! slot, and `accept` only ever waits on a channel (cancel-safe).

use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};
use tokio::task::JoinSet;

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

/// Accepts from `source` until aborted (the listener's drop aborts it, and with it every
/// set-up it started).
pub(super) async fn run(source: Source, shared: Arc<Shared>) {
    let provider = source.provider();
    let mut setups = JoinSet::new();
    let mut backoff = Duration::ZERO;
    loop {
        tokio::select! {
            r = source.accept() => match r {
                Ok(raw) => {
                    backoff = Duration::ZERO;
                    match shared.slots.clone().try_acquire_owned() {
                        Ok(slot) => {
                            setups.spawn(set_up(raw, shared.clone(), slot));
                        }
                        Err(_) => {
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
async fn set_up(raw: Raw, shared: Arc<Shared>, _slot: OwnedSemaphorePermit) {
    let peer = raw.peer();
    let config = &shared.config;
    let work = async {
        match raw.setup(config).await? {
            Some(link) => Connection::establish(link, config).await.map(Some),
            None => Ok(None),
        }
    };
    let result = match tokio::time::timeout(config.handshake_timeout, work).await {
        Ok(r) => r,
        Err(_) => Err(Error::Timeout(format!(
            "{peer} did not finish connection set-up within {} ms (Config::handshake_timeout, IBEX_HANDSHAKE_TIMEOUT_MS); closed it",
            config.handshake_timeout.as_millis()
        ))),
    };
    match result {
        Ok(Some(conn)) => {
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
