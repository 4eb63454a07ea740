//! The reduction of one owned piece: `out[i] = round_once(((in_0[i] + in_1[i]) + in_2[i]) + ...)`,
//! accumulated in float32 in rank order. Each output element depends only on the inputs at the same
//! index, so the result does not depend on how a message is split into chunks or pieces.
//!
//! Work is done in tiles of [`TILE`] elements (first input copied, then the others added one rank at
//! a time), which keeps the accumulator in L1 and lets the compiler vectorise the adds without
//! changing their order.

const TILE: usize = 2048;

/// bfloat16 bits → float32 (exact).
#[inline]
pub fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits(u32::from(bits) << 16)
}

/// float32 → bfloat16 bits, round to nearest even. NaN stays NaN (sign kept, made quiet) instead of
/// carrying into the exponent; finite values above the largest bfloat16 round to ±inf.
#[inline]
pub fn f32_to_bf16(x: f32) -> u16 {
    let bits = x.to_bits();
    if x.is_nan() {
        return ((bits >> 16) as u16) | 0x0040;
    }
    let round = 0x7FFF + ((bits >> 16) & 1);
    ((bits + round) >> 16) as u16
}

/// float32 sum in rank order. `inputs[k]` and `out` have equal lengths.
pub(crate) fn sum_f32(inputs: &[&[f32]], out: &mut [f32]) {
    let (first, rest) = inputs.split_first().expect("world_size >= 1");
    for start in (0..out.len()).step_by(TILE) {
        let end = (start + TILE).min(out.len());
        let acc = &mut out[start..end];
        acc.copy_from_slice(&first[start..end]);
        for input in rest {
            for (a, &b) in acc.iter_mut().zip(&input[start..end]) {
                *a += b;
            }
        }
    }
}

/// bfloat16 inputs, float32 sum in rank order, one rounding to bfloat16 at the end.
pub(crate) fn sum_bf16(inputs: &[&[u16]], out: &mut [u16]) {
    let (first, rest) = inputs.split_first().expect("world_size >= 1");
    let mut tile = [0f32; TILE];
    for start in (0..out.len()).step_by(TILE) {
        let end = (start + TILE).min(out.len());
        let acc = &mut tile[..end - start];
        for (a, &b) in acc.iter_mut().zip(&first[start..end]) {
            *a = bf16_to_f32(b);
        }
        for input in rest {
            for (a, &b) in acc.iter_mut().zip(&input[start..end]) {
                *a += bf16_to_f32(b);
            }
        }
        for (o, &a) in out[start..end].iter_mut().zip(acc.iter()) {
            *o = f32_to_bf16(a);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_rounding_is_nearest_even_and_keeps_nan() {
        assert_eq!(f32_to_bf16(1.0), 0x3F80);
        // Halfway between 0x3F80 and 0x3F81: ties to even (down); just above the tie rounds up.
        assert_eq!(f32_to_bf16(f32::from_bits(0x3F80_8000)), 0x3F80);
        assert_eq!(f32_to_bf16(f32::from_bits(0x3F81_8000)), 0x3F82);
        assert_eq!(f32_to_bf16(f32::from_bits(0x3F80_8001)), 0x3F81);
        assert_eq!(f32_to_bf16(f32::MAX), 0x7F80); // overflows to +inf
        assert_eq!(f32_to_bf16(f32::NEG_INFINITY), 0xFF80);
        // A NaN whose payload would carry into the exponent stays NaN, sign kept.
        let nan = f32_to_bf16(f32::from_bits(0xFFFF_FFFF));
        assert!(bf16_to_f32(nan).is_nan() && nan & 0x8000 != 0);
        let nan = f32_to_bf16(f32::from_bits(0x7F80_0001)); // signalling, payload in low bits
        assert!(bf16_to_f32(nan).is_nan());
    }

    #[test]
    fn sums_add_in_rank_order() {
        // (1 + 1e8) - 1e8 = 0 in f32, whereas (1e8 - 1e8) + 1 = 1: the order is the one given.
        let (a, b, c) = ([1e8f32], [1f32], [-1e8f32]);
        let mut out = [0f32];
        sum_f32(&[&b, &a, &c], &mut out);
        assert_eq!(out[0], 0.0);
        sum_f32(&[&a, &c, &b], &mut out);
        assert_eq!(out[0], 1.0);
        let x: Vec<u16> = [1.0f32, 2.0, 3.0].iter().map(|&v| f32_to_bf16(v)).collect();
        let mut o = [0u16; 3];
        sum_bf16(&[&x, &x], &mut o);
        assert_eq!(o.map(bf16_to_f32), [2.0, 4.0, 6.0]);
    }
}
