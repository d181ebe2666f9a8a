//! Initial values as a pure function of (seed, element index in the whole variable), so a
//! variable split across shards starts exactly as it would unsplit, and every restart of a
//! PS recreates the same values.

use ibex_proto::ps::v1 as pb;

/// SplitMix64: a counter-based generator, so element `i` needs no sequential state.
fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Uniform in (0, 1) from the `k`-th draw for element `i`.
fn uniform(seed: u64, i: u64, k: u64) -> f64 {
    let x = splitmix(seed ^ splitmix(i.wrapping_mul(2).wrapping_add(k)));
    ((x >> 11) as f64 + 0.5) / (1u64 << 53) as f64
}

/// Values for `numel` elements starting at element `first` of a variable of `full_shape`.
pub fn values(
    init: Option<&pb::Initializer>,
    full_shape: &[u64],
    first: u64,
    numel: usize,
) -> Result<Vec<f32>, String> {
    use pb::initializer::Kind;
    let kind = init
        .and_then(|i| i.kind.as_ref())
        .ok_or("no initializer given: set zeros, constant, normal or glorot_uniform")?;
    let whole = full_shape
        .iter()
        .try_fold(1u64, |a, &d| a.checked_mul(d))
        .ok_or_else(|| format!("full shape {full_shape:?} overflows"))?;
    if (numel as u64)
        .checked_add(first)
        .is_none_or(|end| end > whole)
    {
        return Err(format!(
            "elements {first}..+{numel} lie outside the full shape {full_shape:?}"
        ));
    }
    let mut out = Vec::new();
    out.try_reserve_exact(numel)
        .map_err(|e| format!("cannot allocate {numel} elements: {e}"))?;
    let idx = (0..numel as u64).map(|i| first + i);
    match *kind {
        Kind::Zeros(_) => out.resize(numel, 0.0),
        Kind::Constant(c) => out.resize(numel, c),
        Kind::Normal(pb::NormalInit { std, seed }) => {
            if !std.is_finite() || std < 0.0 {
                return Err(format!("normal std {std} must be finite and >= 0"));
            }
            out.extend(idx.map(|i| {
                let (u1, u2) = (uniform(seed, i, 0), uniform(seed, i, 1));
                ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos() * f64::from(std))
                    as f32
            }))
        }
        Kind::GlorotUniform(pb::GlorotUniformInit { seed }) => {
            let fan_in = full_shape.first().copied().unwrap_or(1) as f64;
            // In f64: a product of wire values must not overflow.
            let fan_out = if full_shape.len() > 1 {
                full_shape[1..].iter().map(|&d| d as f64).product::<f64>()
            } else {
                fan_in
            };
            let limit = (6.0 / (fan_in + fan_out).max(1.0)).sqrt();
            out.extend(idx.map(|i| ((uniform(seed, i, 0) * 2.0 - 1.0) * limit) as f32))
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn init(k: pb::initializer::Kind) -> pb::Initializer {
        pb::Initializer { kind: Some(k) }
    }

    #[test]
    fn partitions_match_the_whole() {
        let i = init(pb::initializer::Kind::Normal(pb::NormalInit {
            std: 0.5,
            seed: 7,
        }));
        let whole = values(Some(&i), &[10, 3], 0, 30).unwrap();
        let tail = values(Some(&i), &[10, 3], 12, 18).unwrap();
        assert_eq!(&whole[12..], &tail[..]);
        let mean = whole.iter().sum::<f32>() / 30.0;
        assert!(mean.abs() < 0.5, "mean {mean}");
    }

    #[test]
    fn ranges_outside_the_full_shape_are_refused() {
        let i = init(pb::initializer::Kind::Zeros(pb::Zeros {}));
        let e = values(Some(&i), &[10, 3], 28, 3).unwrap_err();
        assert!(e.contains("outside the full shape"), "{e}");
        let e = values(Some(&i), &[10, 3], u64::MAX, 3).unwrap_err();
        assert!(e.contains("outside the full shape"), "{e}");
        let e = values(Some(&i), &[u64::MAX, 3], 0, 3).unwrap_err();
        assert!(e.contains("overflows"), "{e}");
    }

    #[test]
    fn glorot_stays_within_its_limit() {
        let i = init(pb::initializer::Kind::GlorotUniform(
            pb::GlorotUniformInit { seed: 1 },
        ));
        let v = values(Some(&i), &[64, 10], 0, 640).unwrap();
        let limit = (6.0f32 / 74.0).sqrt();
        assert!(v.iter().all(|x| x.abs() <= limit));
        assert!(
            v.iter().any(|x| x.abs() > limit * 0.9),
            "spread over the whole range"
        );
    }
}
