//! Fuzzes the verbs bootstrap's messages after the preface (`ibex_transport::verbs_wire`):
//! the length header and the queue pair info. Decoding must never panic, lengths are
//! bounded before anything is allocated, and accepted info re-encodes to the same bytes.
#![no_main]

use ibex_transport::verbs_wire::{MAX_BODY, QpInfo, body_len};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // As the bootstrap reads it: a header, then that many bytes of body.
    if let Some((header, rest)) = data.split_first_chunk::<4>()
        && let Ok(len) = body_len(*header)
    {
        assert!(len <= MAX_BODY as usize);
        if let Some(body) = rest.get(..len)
            && let Ok(info) = QpInfo::decode(body)
        {
            assert_eq!(info.encode(), body, "encoding is not canonical");
        }
    }
    if let Ok(info) = QpInfo::decode(data) {
        assert_eq!(info.encode(), data);
    }
});
