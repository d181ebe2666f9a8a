//! Fuzzes the wire-format decoder: it must never panic, and every frame it accepts must
//! re-encode to the same frame (byte for byte, except a `Close` reason that was not valid
//! UTF-8, which decodes lossily).
#![no_main]

use bytes::Bytes;
use ibex_transport::proto::frame::{Body, Frame};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let input = Bytes::copy_from_slice(data);
    let Ok(frame) = Frame::decode(&input) else { return };
    let again = frame.to_bytes();
    assert_eq!(again.len(), frame.encoded_len());
    assert_eq!(Frame::decode(&again).as_ref(), Ok(&frame), "re-encoded frame decodes differently");
    if !matches!(frame.body, Body::Close { .. }) {
        assert_eq!(&again[..], data, "encoding is not canonical");
    }
});
