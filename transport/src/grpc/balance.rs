//! Load balancing over several endpoints, as tonic's `Channel::balance_list` and
//! `Channel::balance_channel`: each call goes to the less loaded of two endpoints picked at
//! random ("power of two choices"), where load is the calls in flight on the endpoint.
//! Endpoints are lazy channels of their own, so any mix of `shm://`, `tcp://`, `verbs://`
//! and `http://` addresses balances, and each reconnects on its own.

use std::cell::Cell;
use std::hash::Hash;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use tokio::sync::Notify;
use tokio::time::Instant;
use tonic::Status;
use tower::discover::Change;

use super::client::{Channel, Inner, Kind};
use super::endpoint::Endpoint;

/// An endpoint whose last connection attempt failed this recently is passed over while
/// another one can take the call.
const PASS_OVER_FAILED: Duration = Duration::from_secs(1);

/// How long a call with no deadline of its own waits for a first endpoint to be added.
pub(super) const NO_ENDPOINT_WAIT: Duration = Duration::from_secs(10);

/// One endpoint of a balanced channel.
#[derive(Clone)]
struct Member {
    channel: Channel,
    /// Calls in flight on it, from the pick until the response head.
    load: Arc<AtomicUsize>,
}

impl Member {
    fn ibex(&self) -> Option<&Arc<Inner>> {
        self.channel.ibex()
    }

    /// Whether a call may go here while others are fine.
    fn usable(&self) -> bool {
        self.ibex()
            .is_none_or(|inner| !inner.failed_within(PASS_OVER_FAILED))
    }
}

/// What all clones of a balanced channel share.
pub(crate) struct Balancer {
    /// The endpoints now, replaced whole on a change so a pick reads it without holding a
    /// lock.
    members: Mutex<Arc<Vec<Member>>>,
    /// Woken when endpoints are added.
    added: Notify,
}

/// A call's claim on its endpoint's load, given back when it is dropped.
pub(crate) struct Load(Arc<AtomicUsize>);

impl Drop for Load {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl Balancer {
    fn new() -> Arc<Balancer> {
        Arc::new(Balancer {
            members: Mutex::new(Arc::new(Vec::new())),
            added: Notify::new(),
        })
    }

    fn snapshot(&self) -> Arc<Vec<Member>> {
        self.members
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    fn set(&self, members: Vec<Member>) {
        let grew = {
            let mut m = self.members.lock().unwrap_or_else(|p| p.into_inner());
            let grew = members.len() > m.len();
            *m = Arc::new(members);
            grew
        };
        if grew {
            self.added.notify_waiters();
        }
    }

    /// The endpoint for a call that must start by `deadline`, with its load counted, and
    /// its connection made where it is an Ibex one. An endpoint that cannot be reached is
    /// passed over for the others; the call fails only when none can take it.
    pub(crate) async fn pick(
        &self,
        deadline: Option<Instant>,
    ) -> std::result::Result<(Channel, Load), Status> {
        let give_up = deadline.unwrap_or_else(|| Instant::now() + NO_ENDPOINT_WAIT);
        let mut tried: Vec<usize> = Vec::new();
        let mut last_error = None;
        loop {
            let added = self.added.notified();
            let members = self.snapshot();
            if members.is_empty() {
                if tokio::time::timeout_at(give_up, added).await.is_err() {
                    return Err(Status::unavailable(
                        "the balanced channel has no endpoints, and none was added before the \
                         call's deadline (10 s for a call without one); add endpoints with \
                         Change::Insert",
                    ));
                }
                continue;
            }
            let open: Vec<usize> = (0..members.len()).filter(|i| !tried.contains(i)).collect();
            if open.is_empty() {
                return Err(last_error.unwrap_or_else(|| {
                    Status::unavailable("no endpoint of the balanced channel can be reached")
                }));
            }
            let usable: Vec<usize> = open
                .iter()
                .copied()
                .filter(|&i| members[i].usable())
                .collect();
            let from = if usable.is_empty() { &open } else { &usable };
            let i = two_choices(from, |i| members[i].load.load(Ordering::Relaxed));
            let m = &members[i];
            m.load.fetch_add(1, Ordering::Relaxed);
            let load = Load(m.load.clone());
            let Some(inner) = m.ibex() else {
                return Ok((m.channel.clone(), load));
            };
            let connected = tokio::time::timeout_at(give_up, inner.connect_status()).await;
            match connected {
                Ok(Ok(())) => return Ok((m.channel.clone(), load)),
                Ok(Err(e)) => last_error = Some(e),
                Err(_) => {
                    return Err(Status::deadline_exceeded(
                        "the call's deadline passed while the balanced channel was connecting",
                    ));
                }
            }
            tried.push(i);
        }
    }
}

/// Of `from` (not empty), the less loaded of two picked at random.
fn two_choices(from: &[usize], load: impl Fn(usize) -> usize) -> usize {
    if from.len() == 1 {
        return from[0];
    }
    let a = random_below(from.len());
    let mut b = random_below(from.len() - 1);
    if b >= a {
        b += 1;
    }
    let (a, b) = (from[a], from[b]);
    if load(b) < load(a) { b } else { a }
}

/// A number below `n` (> 0), from a per-thread xorshift generator: picks need to be spread,
/// not unpredictable.
fn random_below(n: usize) -> usize {
    thread_local! {
        static STATE: Cell<u64> = Cell::new({
            let t = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64);
            let here = &t as *const u64 as u64;
            (t ^ here.rotate_left(32)) | 1
        });
    }
    STATE.with(|s| {
        let mut x = s.get();
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        s.set(x);
        ((x >> 11) % n as u64) as usize
    })
}

impl Channel {
    /// A channel that balances its calls over `list`, as tonic's `Channel::balance_list`:
    /// each call goes to the less loaded of two endpoints picked at random. Each endpoint
    /// connects on its first call and reconnects on its own; one that cannot be reached is
    /// passed over while others can take calls.
    pub fn balance_list(list: impl Iterator<Item = Endpoint>) -> Channel {
        let b = Balancer::new();
        b.set(list.map(|e| member(&e)).collect());
        Channel {
            kind: Kind::Balanced(b),
        }
    }

    /// A balanced channel whose endpoints come and go at run time, as tonic's
    /// `Channel::balance_channel`: send `Change::Insert(key, endpoint)` and
    /// `Change::Remove(key)` on the returned sender (`capacity` changes may wait in it).
    /// Calls in flight on a removed endpoint finish there. While there are no endpoints, a
    /// call waits for one until its deadline (10 s if it has none).
    ///
    /// # Panics
    /// Outside a tokio runtime: the changes are applied by a task, as tonic's are.
    pub fn balance_channel<K>(
        capacity: usize,
    ) -> (Channel, tokio::sync::mpsc::Sender<Change<K, Endpoint>>)
    where
        K: Hash + Eq + Send + Clone + 'static,
    {
        let b = Balancer::new();
        let (tx, rx) = tokio::sync::mpsc::channel(capacity.max(1));
        tokio::spawn(apply_changes(Arc::downgrade(&b), rx));
        (
            Channel {
                kind: Kind::Balanced(b),
            },
            tx,
        )
    }
}

fn member(e: &Endpoint) -> Member {
    Member {
        channel: e.connect_lazy(),
        load: Arc::new(AtomicUsize::new(0)),
    }
}

/// Applies changes until the sender or the channel is gone.
async fn apply_changes<K: Hash + Eq + Clone>(
    balancer: Weak<Balancer>,
    mut rx: tokio::sync::mpsc::Receiver<Change<K, Endpoint>>,
) {
    let mut keys: Vec<K> = Vec::new();
    let mut members: Vec<Member> = Vec::new();
    while let Some(change) = rx.recv().await {
        let Some(b) = balancer.upgrade() else { return };
        match change {
            Change::Insert(k, e) => match keys.iter().position(|x| *x == k) {
                Some(i) => members[i] = member(&e),
                None => {
                    keys.push(k);
                    members.push(member(&e));
                }
            },
            Change::Remove(k) => {
                if let Some(i) = keys.iter().position(|x| *x == k) {
                    keys.swap_remove(i);
                    members.swap_remove(i);
                }
            }
        }
        b.set(members.clone());
    }
}
