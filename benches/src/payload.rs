//! TF-gRPC-Bench payloads: a list of buffers drawn from three size categories.
//!
//! The definitions (categories, defaults, ranges, schemes) follow Biswas, Lu and Panda,
//! "Characterizing and Optimizing TensorFlow's gRPC Channel" (TF-gRPC-Bench), so numbers from
//! this tool can be set beside the paper's.

use bytes::Bytes;
use clap::ValueEnum;
use ibex_proto::bench::v1::Payload;

/// A buffer size category of TF-gRPC-Bench.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Category {
    /// Default 10 B, range [1 B, 1 KiB).
    Small,
    /// Default 10 KiB, range [1 KiB, 1 MiB).
    Medium,
    /// Default 1 MiB, range [1 MiB, 10 MiB].
    Large,
}

impl Category {
    /// The paper's default size of a buffer in this category.
    pub fn default_size(self) -> usize {
        match self {
            Category::Small => 10,
            Category::Medium => 10 << 10,
            Category::Large => 1 << 20,
        }
    }

    /// The paper's inclusive size range of this category.
    pub fn range(self) -> (usize, usize) {
        match self {
            Category::Small => (1, (1 << 10) - 1),
            Category::Medium => (1 << 10, (1 << 20) - 1),
            Category::Large => (1 << 20, 10 << 20),
        }
    }
}

/// How the buffers of one payload get their categories.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Scheme {
    /// Every buffer from one category (`--category`).
    Uniform,
    /// Each buffer's category drawn at random.
    Random,
    /// Fixed shares of Large/Medium/Small (`--skew`, default 60/30/10).
    Skew,
}

/// Everything that decides a payload's buffers.
#[derive(Clone, Debug)]
pub struct PayloadSpec {
    /// Category scheme.
    pub scheme: Scheme,
    /// Category for [`Scheme::Uniform`].
    pub category: Category,
    /// Number of buffers per payload.
    pub buffers: usize,
    /// Large/Medium/Small percentages for [`Scheme::Skew`].
    pub skew: [u32; 3],
    /// Draw each buffer's size from its category's range instead of using the default size.
    pub randomize_sizes: bool,
    /// Seed of the (deterministic) generator, so two transports get the same payload.
    pub seed: u64,
}

/// splitmix64: enough randomness for picking sizes, and the same sequence on every run.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

impl PayloadSpec {
    /// The buffer sizes of the payload, in order.
    pub fn sizes(&self) -> Vec<usize> {
        let mut rng = Rng(self.seed);
        let cats: Vec<Category> = match self.scheme {
            Scheme::Uniform => vec![self.category; self.buffers],
            Scheme::Random => (0..self.buffers)
                .map(|_| {
                    [Category::Small, Category::Medium, Category::Large][rng.below(3) as usize]
                })
                .collect(),
            Scheme::Skew => {
                // Exact shares, rounded, so a 10-buffer payload is always 6 L + 3 M + 1 S.
                let total: u32 = self.skew.iter().sum::<u32>().max(1);
                let large =
                    (self.buffers as u64 * self.skew[0] as u64 + total as u64 / 2) / total as u64;
                let medium =
                    (self.buffers as u64 * self.skew[1] as u64 + total as u64 / 2) / total as u64;
                let large = (large as usize).min(self.buffers);
                let medium = (medium as usize).min(self.buffers - large);
                let mut v = vec![Category::Large; large];
                v.extend(std::iter::repeat_n(Category::Medium, medium));
                v.extend(std::iter::repeat_n(
                    Category::Small,
                    self.buffers - large - medium,
                ));
                // Interleave, as a real tensor list would be.
                for i in (1..v.len()).rev() {
                    v.swap(i, rng.below(i as u64 + 1) as usize);
                }
                v
            }
        };
        cats.into_iter()
            .map(|c| {
                if self.randomize_sizes {
                    let (lo, hi) = c.range();
                    lo + rng.below((hi - lo + 1) as u64) as usize
                } else {
                    c.default_size()
                }
            })
            .collect()
    }

    /// A short label for tables: `skew x10`, `uniform/small x10`.
    pub fn label(&self) -> String {
        let r = if self.randomize_sizes { " rnd" } else { "" };
        match self.scheme {
            Scheme::Uniform => format!(
                "uniform/{} x{}{r}",
                format!("{:?}", self.category).to_lowercase(),
                self.buffers
            ),
            Scheme::Random => format!("random x{}{r}", self.buffers),
            Scheme::Skew => format!("skew x{}{r}", self.buffers),
        }
    }
}

/// One message in all the shapes the transports need, built once so building is not timed.
#[derive(Clone)]
pub struct Msg {
    /// For the gRPC transports.
    pub payload: Payload,
    /// For the raw transport: the buffers concatenated (the raw transport has no buffer list),
    /// first byte set by the client to say echo or sink.
    pub raw: Bytes,
    /// Total payload bytes (one direction).
    pub bytes: usize,
}

impl Msg {
    /// Builds the message for the given buffer sizes. `tag` is the raw transport's first byte.
    pub fn new(sizes: &[usize], tag: u8) -> Msg {
        let buffers: Vec<Bytes> = sizes
            .iter()
            .enumerate()
            .map(|(i, &s)| Bytes::from(vec![i as u8 | 1; s]))
            .collect();
        let bytes: usize = sizes.iter().sum();
        let mut raw = vec![0x5a; bytes.max(1)];
        raw[0] = tag;
        Msg {
            payload: Payload { buffers },
            raw: Bytes::from(raw),
            bytes,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(scheme: Scheme) -> PayloadSpec {
        PayloadSpec {
            scheme,
            category: Category::Small,
            buffers: 10,
            skew: [60, 30, 10],
            randomize_sizes: false,
            seed: 1,
        }
    }

    #[test]
    fn skew_default_is_six_large_three_medium_one_small() {
        let s = spec(Scheme::Skew).sizes();
        assert_eq!(s.len(), 10);
        assert_eq!(s.iter().filter(|&&x| x == 1 << 20).count(), 6);
        assert_eq!(s.iter().filter(|&&x| x == 10 << 10).count(), 3);
        assert_eq!(s.iter().filter(|&&x| x == 10).count(), 1);
    }

    #[test]
    fn uniform_small_uses_paper_default() {
        assert_eq!(spec(Scheme::Uniform).sizes(), vec![10; 10]);
    }

    #[test]
    fn randomized_sizes_stay_in_their_category_range_and_repeat() {
        for scheme in [Scheme::Random, Scheme::Skew] {
            let mut sp = spec(scheme);
            sp.randomize_sizes = true;
            let a = sp.sizes();
            assert_eq!(a, sp.sizes(), "same seed, same payload");
            for &x in &a {
                assert!((1..=10 << 20).contains(&x));
            }
        }
        let mut sp = spec(Scheme::Uniform);
        sp.randomize_sizes = true;
        sp.category = Category::Medium;
        assert!(sp.sizes().iter().all(|&x| (1 << 10..1 << 20).contains(&x)));
    }

    #[test]
    fn raw_message_concatenates_and_tags() {
        let m = Msg::new(&[3, 4], 7);
        assert_eq!(m.bytes, 7);
        assert_eq!(m.raw.len(), 7);
        assert_eq!(m.raw[0], 7);
        assert_eq!(m.payload.buffers.len(), 2);
    }
}
