//! Errors. Every message names the problem and, where there is one, the fix.

use std::io;

/// What went wrong on a connection or while setting one up.
#[derive(Debug, thiserror::Error, Clone)]
pub enum Error {
    /// The peer broke the protocol (malformed, hostile or out-of-bounds frame). The connection is closed.
    #[error("protocol violation by peer: {0}")]
    Protocol(String),
    /// The peer closed the connection, cleanly or with an error it reported.
    #[error("connection closed by peer{}", fmt_reason(.0))]
    PeerClosed(String),
    /// This side closed the connection.
    #[error("connection closed locally")]
    LocallyClosed,
    /// The peer went away without closing (process died, socket reset).
    #[error("peer is gone: {0}")]
    PeerGone(String),
    /// A message exceeds a configured limit.
    #[error(
        "message of {len} bytes exceeds the limit of {limit} bytes ({which}); raise it in the transport Config on both sides"
    )]
    TooLarge {
        /// Size of the offending message.
        len: u64,
        /// The limit in force.
        limit: u64,
        /// Which limit (`max_message_size` of this side or of the peer).
        which: &'static str,
    },
    /// A caller-provided receive buffer is smaller than the message that arrived for it.
    #[error("receive buffer of {buf} bytes is too small for a message of {len} bytes")]
    BufferTooSmall {
        /// Size of the buffer.
        buf: usize,
        /// Size of the message.
        len: u64,
    },
    /// Bad address or URI.
    #[error("bad address {addr:?}: {why}")]
    Address {
        /// The address as given.
        addr: String,
        /// What is wrong with it.
        why: String,
    },
    /// The handshake failed (version, auth token, parameters).
    #[error("handshake failed: {0}")]
    Handshake(String),
    /// A provider-level failure (syscall, device) with context.
    #[error("{context}: {source}")]
    Io {
        /// What Ibex was doing.
        context: String,
        /// The OS error.
        #[source]
        source: std::sync::Arc<io::Error>,
    },
    /// A message could not be encoded as it announced: this side's fault (a `prost::Message`
    /// impl whose encoding disagrees with its `encoded_len`), refused before anything is sent.
    #[error("encoding failed: {0}")]
    Encode(String),
    /// Configuration is invalid.
    #[error("invalid configuration: {0}")]
    Config(String),
    /// The operation timed out.
    #[error("timed out: {0}")]
    Timeout(String),
}

fn fmt_reason(r: &str) -> String {
    if r.is_empty() {
        String::new()
    } else {
        format!(": {r}")
    }
}

impl Error {
    /// Wraps an I/O error with what Ibex was doing when it happened.
    pub fn io(context: impl Into<String>, source: io::Error) -> Self {
        Error::Io {
            context: context.into(),
            source: std::sync::Arc::new(source),
        }
    }
}

/// Shorthand for results in this crate.
pub type Result<T, E = Error> = std::result::Result<T, E>;
