//! Fuzzes the PS's request handling: a method byte, then the protobuf body a worker would
//! send, through `PsService` into small shards (see `ibex_ps::fuzzing`). It must never
//! panic, hang or allocate past the shard's limits, whatever the shapes, offsets, dtypes,
//! names, ids and steps say.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Err(e) = ibex_ps::fuzzing::feed(data) {
        panic!("{e}");
    }
});
