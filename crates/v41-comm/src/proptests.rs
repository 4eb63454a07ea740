//! Property: for any world size, lane size and message length, every rank's all-reduce result is
//! bit-identical to the fixed-order reference (so also identical across ranks and chunkings).

use proptest::prelude::*;

use crate::reduce::f32_to_bf16;
use crate::tests::{reduce_bf16, reduce_f32, reference_bf16, reference_f32, values};

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    #[test]
    fn all_reduce_equals_fixed_order_reference_on_every_rank(
        world in 1usize..=4,
        lanes in 1usize..=16,
        len in 0usize..2000,
        seed in any::<u64>(),
        bf16 in any::<bool>(),
    ) {
        let lane_bytes = 64 * lanes;
        let inputs: Vec<Vec<f32>> = (0..world).map(|r| values(len, seed ^ r as u64)).collect();
        if bf16 {
            let inputs: Vec<Vec<u16>> =
                inputs.iter().map(|x| x.iter().copied().map(f32_to_bf16).collect()).collect();
            let expected = reference_bf16(&inputs);
            for out in reduce_bf16(world, lane_bytes, &inputs) {
                prop_assert_eq!(&out, &expected);
            }
        } else {
            let expected: Vec<u32> = reference_f32(&inputs).iter().map(|x| x.to_bits()).collect();
            for out in reduce_f32(world, lane_bytes, &inputs) {
                let got: Vec<u32> = out.iter().map(|x| x.to_bits()).collect();
                prop_assert_eq!(&got, &expected);
            }
        }
    }
}
