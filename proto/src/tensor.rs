//! f32 tensors as the wire's little-endian bytes (`Tensor.data`, checkpoints). One copy each
//! way: on little-endian hosts the conversion is a cast plus a memcpy, where a per-element
//! loop costs the PS and the worker about 15% of a ResNet-50 step (perf, `ibex-bench
//! ps-step`).

use bytes::Bytes;

/// `v` as little-endian bytes, in one new buffer.
pub fn f32_to_le_bytes(v: &[f32]) -> Bytes {
    Bytes::from(f32_to_le_vec(v))
}

/// `v` as little-endian bytes, in a `Vec`.
pub fn f32_to_le_vec(v: &[f32]) -> Vec<u8> {
    #[cfg(target_endian = "little")]
    {
        bytemuck::cast_slice::<f32, u8>(v).to_vec()
    }
    #[cfg(target_endian = "big")]
    {
        v.iter().flat_map(|x| x.to_le_bytes()).collect()
    }
}

/// The f32 values of little-endian bytes `b`; a trailing partial value (`b.len() % 4`
/// bytes) is ignored, so callers check the length first. Works at any alignment of `b`.
pub fn f32_from_le_bytes(b: &[u8]) -> Vec<f32> {
    let whole = &b[..b.len() - b.len() % 4];
    #[cfg(target_endian = "little")]
    {
        bytemuck::pod_collect_to_vec::<u8, f32>(whole)
    }
    #[cfg(target_endian = "big")]
    {
        whole
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect()
    }
}

/// Overwrites `dst` with the f32 values of little-endian bytes `b` (`b.len() == 4 *
/// dst.len()`, checked by the caller): the decode into a buffer the caller reuses, one
/// memcpy on little-endian machines.
pub fn f32_from_le_into(dst: &mut [f32], b: &[u8]) {
    #[cfg(target_endian = "little")]
    {
        bytemuck::cast_slice_mut::<f32, u8>(dst).copy_from_slice(b)
    }
    #[cfg(target_endian = "big")]
    for (d, c) in dst.iter_mut().zip(b.chunks_exact(4)) {
        *d = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_at_any_alignment_and_matches_to_le_bytes() {
        let v: Vec<f32> = (0..1001).map(|i| i as f32 * -0.37 + 1e-3).collect();
        let b = f32_to_le_bytes(&v);
        let expected: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        assert_eq!(&b[..], &expected[..]);
        for shift in 0..4 {
            let mut shifted = vec![0u8; shift];
            shifted.extend_from_slice(&b);
            assert_eq!(f32_from_le_bytes(&shifted[shift..]), v, "offset {shift}");
            let mut into = vec![0f32; v.len()];
            f32_from_le_into(&mut into, &shifted[shift..]);
            assert_eq!(into, v, "into, offset {shift}");
        }
        assert_eq!(
            f32_from_le_bytes(&b[..7]),
            vec![v[0]],
            "a partial value is dropped"
        );
        assert!(f32_from_le_bytes(&[]).is_empty());
    }
}
