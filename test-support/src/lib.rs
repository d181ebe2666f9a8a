//! What the integration tests of the workspace share: a launcher for server processes such
//! as `ibex-ps` ([`Launch`], [`Server`]), free local ports ([`free_port`]) and
//! deterministic test data ([`pattern`]).

mod pattern;
mod ports;
mod process;

pub use pattern::pattern;
pub use ports::{free_port, free_port_on};
pub use process::{Launch, LaunchError, Server};
