//! The wire format. (Being written.)

/// Bytes of every frame header.
pub const HEADER_LEN: usize = 12;
