//! The protocol state machine of one connection. (API fixed; body being written.)

use std::time::Instant;

use bytes::Bytes;

use super::{Action, MsgId, Protocol, ProtoStats, RecvMode};
use crate::config::Config;
use crate::error::Error;

/// One connection's protocol state. See the module docs of [`crate::proto`].
pub struct Connection {
    _p: (),
}

#[allow(unused_variables, missing_docs)]
impl Connection {
    /// A new connection. It queues its `Hello` at once; data frames wait for the peer's.
    pub fn new(config: &Config, now: Instant) -> Self { todo!() }
    /// A frame arrived from the peer. Protocol violations close the connection
    /// (a `Close` frame to the peer, then [`Action::Closed`]); they never panic.
    pub fn handle_frame(&mut self, now: Instant, frame: Bytes) { todo!() }
    /// A read issued as [`Action::Read`] finished.
    pub fn read_completed(&mut self, now: Instant, id: u64, result: Result<(), Error>) { todo!() }
    /// Time has reached `now` (drives the probe's bookkeeping and any deadlines).
    pub fn handle_timeout(&mut self, now: Instant) { todo!() }
    /// When the core next wants `handle_timeout`.
    pub fn poll_timeout(&self) -> Option<Instant> { todo!() }
    /// Which protocol a message of `len` bytes would use now; `Err(TooLarge)` if either
    /// side's `max_message_size` forbids it.
    pub fn classify(&self, len: u64) -> Result<Protocol, Error> { todo!() }
    /// Queues an eager message (`data.len()` must be within the threshold / slot).
    pub fn send_eager(&mut self, now: Instant, data: Bytes) -> Result<MsgId, Error> { todo!() }
    /// Queues the RTS of a rendezvous message whose buffer the driver exposed as `descriptor`.
    pub fn send_rendezvous(&mut self, now: Instant, len: u64, descriptor: Bytes) -> Result<MsgId, Error> { todo!() }
    /// The driver's answer to [`Action::BeginRecv`].
    pub fn accept_rendezvous(&mut self, now: Instant, msg: MsgId, mode: RecvMode) { todo!() }
    /// The driver could not prepare a destination for `msg` (allocation failed, bad
    /// descriptor): the connection closes with `error`.
    pub fn reject_rendezvous(&mut self, now: Instant, msg: MsgId, error: Error) { todo!() }
    /// The application took delivered message `msg`: its credit may go back.
    pub fn consumed(&mut self, msg: MsgId) { todo!() }
    /// A [`RecvMode::Mapped`] message's view was dropped: tell the sender it may release.
    pub fn release_recv(&mut self, msg: MsgId) { todo!() }
    /// Starts the threshold probe, using an exposed zero-filled buffer of `len` bytes
    /// (`len` ≥ the largest probe size in `ProbePlan`) for its rendezvous samples.
    pub fn start_probe(&mut self, now: Instant, descriptor: Bytes, len: usize) { todo!() }
    /// Graceful close: no new sends; once queued frames are out and every rendezvous the
    /// peer is reading has been released, a `Close` goes out and [`Action::Closed`] follows.
    pub fn close(&mut self, now: Instant, reason: &str) { todo!() }
    /// The link died: fail everything pending with `error` at once.
    pub fn link_failed(&mut self, error: Error) { todo!() }
    /// The next frame to hand to the link, if any (coalescing happens here).
    pub fn poll_transmit(&mut self, now: Instant) -> Option<Bytes> { todo!() }
    /// The next action, if any.
    pub fn poll_action(&mut self) -> Option<Action> { todo!() }
    /// Counters.
    pub fn stats(&self) -> &ProtoStats { todo!() }
    /// The eager threshold in force.
    pub fn eager_threshold(&self) -> usize { todo!() }
    /// True once [`Action::Closed`] has been emitted.
    pub fn is_closed(&self) -> bool { todo!() }
    /// Application messages queued but not yet put into a frame (send backpressure).
    pub fn queued_data_frames(&self) -> usize { todo!() }
    /// True once the peer's `Hello` arrived.
    pub fn is_established(&self) -> bool { todo!() }
}
