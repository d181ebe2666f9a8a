//! The sans-IO protocol core (quinn-proto style).
//!
//! It does no I/O and reads no clock. The connection driver feeds it events (a frame
//! arrived, a read completed, the application sent or consumed a message, time is now T)
//! and drains what it wants done: frames to transmit ([`Connection::poll_transmit`]) and
//! [`Action`]s ([`Connection::poll_action`]). Tests drive two instances over a simulated
//! link deterministically (`tests/proto_sim.rs`).
//!
//! What it owns:
//! - the versioned wire format ([`frame`]);
//! - eager messages into the peer's slots, with credit-based flow control;
//! - rendezvous: RTS with the provider's descriptor, receiver-driven fragmented reads with
//!   several in flight, and the completion (`RndvDone`) that releases the sender's buffer;
//! - coalescing of small messages queued while the link is busy;
//! - the connect-time probe, which picks the eager threshold and the fragment size;
//! - the decisions that depend on what the link can do ([`LinkCaps`]): what the probe
//!   measures, whether a send is copied into registered memory or registered, whether a
//!   body is pushed behind its RTS;
//! - in-order delivery, whatever order reads complete in.
//!
//! Flow control. Each data frame (`Eager`, `Rts`, `ProbeEager`, `ProbeRts`) takes one of the
//! peer's credits; control frames (`Credit`, `RndvDone`, `ProbeAck`, `Close`) take none, and
//! the protocol bounds how many of them can be in flight (see `docs/protocol.md`). A credit
//! comes back (piggy-backed on any frame's header, or in a `Credit` frame once half the
//! window is owed) when every message of the frame has been consumed by the application, so
//! unread data is bounded by `credits × slot_size` plus the rendezvous messages in flight.

mod caps;
mod conn;
pub mod frame;
mod probe;

pub use caps::{COPY_MAX, LinkCaps, Staging};
pub use conn::{CLOSE_DRAIN_TIMEOUT, Connection, Transmit};
pub use probe::{
    FRAGMENT_CANDIDATES, FRAGMENT_PROBE_LEN, FragmentCost, PROBE_TIMEOUT, ProbePlan, SizeCost,
    choose_fragment, choose_threshold,
};

use bytes::Bytes;

use crate::error::Error;

/// Wire-format version carried in every frame header.
pub const VERSION: u8 = 1;
/// Bytes of every frame header.
pub const HEADER_LEN: usize = frame::HEADER_LEN;
/// Bytes an eager frame with one message adds around the payload.
pub const EAGER_OVERHEAD: usize = frame::HEADER_LEN + 2 + 4;

/// Sequence number of a message on one direction of a connection (0, 1, 2, ...). Sender and
/// receiver number the same message the same way.
pub type MsgId = u64;

/// Set in the [`MsgId`] of probe samples ([`Action::BeginRecv`] with `probe: true`, and the
/// `Read`/`Discard` actions that follow): probes have their own id space (the low 32 bits
/// are the probe id) and never shift message numbering.
pub const PROBE_MSG_BIT: u64 = 1 << 63;

/// How a message travels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    /// Copied into one of the peer's pre-allocated slots.
    Eager,
    /// Announced with a descriptor and pulled by the receiver.
    Rendezvous,
}

/// Where a rendezvous message lands, chosen by the driver for each [`Action::BeginRecv`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecvMode {
    /// Pull it with fragmented reads into a buffer the driver allocated.
    Read,
    /// The driver mapped the sender's memory directly: no reads. The sender's buffer stays
    /// held until [`Connection::release_recv`].
    Mapped,
}

/// What the core wants the driver to do.
#[derive(Debug)]
pub enum Action {
    /// A rendezvous message was announced. The driver prepares a destination (or maps the
    /// descriptor) and calls [`Connection::accept_rendezvous`].
    BeginRecv {
        /// The message.
        msg: MsgId,
        /// Bytes to read.
        len: u64,
        /// Bytes of the message's head, which came in its RTS and goes before the bytes
        /// read ([`Delivery::Rendezvous`]): a destination the caller chose must hold both.
        head_len: usize,
        /// The sender's descriptor, as the provider encoded it.
        descriptor: Bytes,
        /// True for the threshold probe: never delivered, discarded once read.
        probe: bool,
    },
    /// Read `len` bytes at `remote_offset` of `descriptor` into the destination of `msg` at
    /// `local_offset`; report with [`Connection::read_completed`] using `id`.
    Read {
        /// Read id, unique while in flight.
        id: u64,
        /// The message this fragment belongs to.
        msg: MsgId,
        /// The sender's descriptor.
        descriptor: Bytes,
        /// Offset in the remote region.
        remote_offset: u64,
        /// Offset in the local destination.
        local_offset: u64,
        /// Fragment length.
        len: usize,
    },
    /// The next message, in order. Call [`Connection::consumed`] once the application took it.
    Deliver {
        /// The message.
        msg: MsgId,
        /// Its payload, or where it is.
        data: Delivery,
    },
    /// Sender side: the peer is done with rendezvous message `msg`; withdraw its exposure.
    Release {
        /// The message.
        msg: MsgId,
    },
    /// Receiver side: drop the destination of `msg` (probe done, or the message failed).
    Discard {
        /// The message.
        msg: MsgId,
    },
    /// The connect-time probe is over (finished, abandoned, or never able to start): the
    /// driver may withdraw its buffer. Carries the settings now in force.
    ProbeDone {
        /// Bytes: messages up to this size go eager.
        threshold: usize,
        /// Bytes per rendezvous read on this side ([`Connection::fragment_size`]).
        fragment_size: usize,
    },
    /// The connection is over. Every pending send and receive fails with `error`
    /// (`Error::LocallyClosed` / `Error::PeerClosed` on a clean close).
    ///
    /// It comes first; right after it follow a [`Action::Discard`] for every message
    /// being received, a [`Action::Release`] for every rendezvous send not yet released
    /// (these fail with `error`), and a [`Action::ProbeDone`] if a probe was still
    /// running. Nothing else follows.
    Closed {
        /// Why.
        error: Error,
    },
}

/// The payload of a delivered message.
#[derive(Debug)]
pub enum Delivery {
    /// An eager message: the bytes themselves.
    Eager(Bytes),
    /// A rendezvous message: it sits in the destination the driver prepared for it, after
    /// `head` if it is a two-part message ([`Connection::send_parts`]).
    Rendezvous {
        /// Bytes in the destination.
        len: u64,
        /// The message's head, which came in its RTS (empty for a plain rendezvous message).
        head: Bytes,
    },
}

/// Counters kept by the core (the driver adds provider-level ones).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ProtoStats {
    /// Messages sent eagerly.
    pub eager_msgs_sent: u64,
    /// Payload bytes sent eagerly.
    pub eager_bytes_sent: u64,
    /// Messages sent by rendezvous.
    pub rndv_msgs_sent: u64,
    /// Payload bytes sent by rendezvous.
    pub rndv_bytes_sent: u64,
    /// Messages received eagerly.
    pub eager_msgs_recv: u64,
    /// Payload bytes received eagerly.
    pub eager_bytes_recv: u64,
    /// Messages received by rendezvous.
    pub rndv_msgs_recv: u64,
    /// Payload bytes received by rendezvous.
    pub rndv_bytes_recv: u64,
    /// Messages that shared an eager frame with at least one other.
    pub coalesced_msgs: u64,
    /// Times a data frame was ready but had to wait for credits.
    pub credit_stalls: u64,
    /// Frames sent / received (all kinds).
    pub frames_sent: u64,
    /// Frames received (all kinds).
    pub frames_recv: u64,
    /// Fragment reads issued.
    pub reads_issued: u64,
    /// Times a rendezvous message had to wait for the receive budget
    /// (`Config::rndv_recv_budget`) before this side gave it memory.
    pub rndv_recv_deferred: u64,
    /// The eager threshold in force.
    pub eager_threshold: usize,
    /// How the threshold was chosen: `"probe"`, `"config"`, `"env"`, `"default"`, or `"link"`
    /// (the largest message a slot of the peer's takes, where the link says eager always
    /// wins: `Config::probe_threshold`).
    pub threshold_source: &'static str,
    /// The rendezvous fragment size in force for this side's reads.
    pub fragment_size: usize,
    /// How the fragment size was chosen: `"probe"`, `"config"`, `"env"` or `"default"`.
    pub fragment_source: &'static str,
}
