//! Fuzzes a tcp link against a scripted hostile peer: records, pushes, answers and asks
//! from the peer, reads and exposures from the link's owner (`../tcp_script.rs` says what
//! a script is and what must hold).
#![no_main]

use libfuzzer_sys::fuzz_target;

#[path = "../tcp_script.rs"]
mod tcp_script;

fuzz_target!(|data: &[u8]| {
    tcp_script::run(data);
});
