//! Deterministic test data.

use bytes::Bytes;

/// The period of [`pattern`]: a prime above a page, so that no power-of-two fragment, slot,
/// ring or page size is a multiple of it, and short enough to compute per call in debug
/// builds.
const PERIOD: usize = 65_521;

/// `len` bytes of test data for `seed`. Every byte depends on its position, with a period of
/// 65 521 bytes: a copy shifted by anything less, or a chunk that landed a few
/// power-of-two fragments or slots away from its place, does not compare equal, and no two
/// 4 KiB pages of one pattern are alike. The first byte is `seed` itself, so a receiver can
/// tell which pattern a message carries; a longer pattern of a seed starts with every
/// shorter one.
pub fn pattern(len: usize, seed: u8) -> Bytes {
    // One period computed, the rest copied: `extend_from_slice` stays fast in debug builds
    // even for 64 MiB.
    let period: Vec<u8> = (0..PERIOD.min(len) as u32)
        .map(|i| ((i.wrapping_mul(2_654_435_761) >> 24) as u8).wrapping_add(seed))
        .collect();
    let mut v = Vec::with_capacity(len);
    while v.len() < len {
        let take = (len - v.len()).min(period.len());
        v.extend_from_slice(&period[..take]);
    }
    Bytes::from(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn seeded_positional_and_prefix_stable() {
        for seed in [0u8, 1, 200, 255] {
            let p = pattern(3 * PERIOD + 7, seed);
            assert_eq!(p[0], seed);
            assert_eq!(p[..1000], pattern(1000, seed)[..]);
            assert_eq!(p[..PERIOD], p[PERIOD..2 * PERIOD]);
            for shift in [1, 7, 251, 4096, 65_536] {
                assert_ne!(p[..PERIOD], p[shift..shift + PERIOD], "shift {shift}");
            }
        }
        assert_ne!(pattern(100, 1), pattern(100, 2));
        assert!(pattern(0, 3).is_empty());
        let mib = pattern(1 << 20, 9);
        let pages: std::collections::BTreeSet<&[u8]> = mib.chunks(4096).collect();
        assert_eq!(pages.len(), 256, "every page differs");
    }
}
