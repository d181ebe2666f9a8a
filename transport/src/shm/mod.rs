//! The `shm` provider: two processes on one host, talking through shared memory.
//!
//! Setup (`setup.rs`) happens over a Unix stream socket: a versioned hello, an optional auth
//! token check, then each side passes sealed memfds and eventfds with `SCM_RIGHTS`. The
//! socket then stays open for the connection's life so each side notices the other's
//! death (end of stream) or clean close.
//!
//! Data paths of a [`ShmLink`]:
//! - eager frames go through a lock-free SPSC ring (`ring.rs`) in a segment the sender owns
//!   and the receiver maps, one ring per direction;
//! - rendezvous from the registered pool ([`crate::link::Link::pool`], one memfd per side
//!   and process pair, shared by all the pair's connections (`share.rs`), mapped read-only
//!   by the peer) needs no copy at all: the receiver maps the descriptor
//!   ([`crate::link::Link::map_remote`]);
//! - rendezvous from any other buffer is a single copy with CMA (`cma.rs`,
//!   `process_vm_readv`) or, where CMA is denied, a pipelined copy through the owner's
//!   bounce area (`link.rs` documents the records).
//!
//! Waiting is spin-then-sleep: a side with nothing to do spins briefly, then raises a flag
//! in the ring header and sleeps on an eventfd that the other side writes only when the
//! flag is up. An idle connection costs no CPU.
//!
//! Operation notes (paths, fallback, tuning) are in `docs/shm.md`.

mod cma;
mod link;
pub(crate) mod ring;
mod segment;
mod setup;
mod share;

pub use link::ShmLink;
pub use setup::{SETUP_TIMEOUT, ShmListener, check_peer_preface, connect, listen};
pub(crate) use setup::{SocketFile, accept_setup};
