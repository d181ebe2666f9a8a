//! Fuzzes the gRPC call framing a peer can reach: arbitrary transport messages into one
//! connection's demultiplexer, on the server side and the client side. It must never
//! panic or allocate by an untrusted count, and every packet it accepts must re-encode
//! stably.
#![no_main]

use ibex_transport::fuzzing::{feed, split_messages};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let messages = split_messages(data);
    for request in [true, false] {
        if let Err(e) = feed(&messages, request) {
            panic!("{e}");
        }
    }
});
