//! Fuzzes the set-up preface every provider reads first (`ibex_transport::preface`), and
//! shm's bytes in it: decoding must never panic nor allocate more than the limits allow,
//! and every preface it accepts must re-encode to the same bytes.
#![no_main]

use ibex_transport::preface::{self, Provider};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    for provider in [Provider::Shm, Provider::Tcp, Provider::Verbs] {
        let Ok(p) = preface::decode(provider, data, "fuzz") else { continue };
        assert!(p.token.len() <= preface::MAX_TOKEN && p.ext.len() <= preface::MAX_EXT);
        assert_eq!(p.encode(provider), data, "encoding is not canonical");
        let _ = preface::authenticate(b"token", &p.token, "fuzz");
        if provider == Provider::Shm {
            let _ = ibex_transport::shm::check_peer_preface(&p);
        }
    }
});
