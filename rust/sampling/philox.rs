//! Philox4x32-10 (Salmon et al., SC'11): a counter-based generator, so every random draw is a pure
//! function of (key, counter), and the Gumbel noise made from it. The decode megakernel computes
//! the same functions on the GPU (cuda/ops/step_sample.cuh) bit for bit: the known-answer tests
//! below pin the definition both sides follow, and the logarithm is this module's own (separately
//! rounded f32 products, sums and one quotient, which CUDA's `__fmul_rn`, `__fadd_rn` and
//! `__fdiv_rn` reproduce exactly), not the C library's or the GPU's, which may round differently.

const M0: u32 = 0xD251_1F53;
const M1: u32 = 0xCD9E_8D57;
const W0: u32 = 0x9E37_79B9;
const W1: u32 = 0xBB67_AE85;

fn mulhilo(a: u32, b: u32) -> (u32, u32) {
    let p = u64::from(a) * u64::from(b);
    ((p >> 32) as u32, p as u32)
}

/// Ten rounds of Philox4x32 over `ctr` with `key` (the key is bumped before rounds 2..10).
pub fn philox4x32_10(mut ctr: [u32; 4], mut key: [u32; 2]) -> [u32; 4] {
    for round in 0..10 {
        if round > 0 {
            key = [key[0].wrapping_add(W0), key[1].wrapping_add(W1)];
        }
        let (hi0, lo0) = mulhilo(M0, ctr[0]);
        let (hi1, lo1) = mulhilo(M1, ctr[2]);
        ctr = [hi1 ^ ctr[1] ^ key[0], lo1, hi0 ^ ctr[3] ^ key[1], lo0];
    }
    ctr
}

/// The 32 random bits that decide token `vocab_id` at generation step `index` of a request seeded
/// with `seed`: key = (seed low, seed high), counter = (vocab id, index, 0, 0), first output word.
/// No batch row enters, so a request draws the same numbers whatever shares its batch.
pub fn token_bits(seed: u64, index: u32, vocab_id: u32) -> u32 {
    philox4x32_10([vocab_id, index, 0, 0], [seed as u32, (seed >> 32) as u32])[0]
}

/// A uniform in (0, 1) from the top 23 bits: (b + 0.5) / 2^23 needs at most 24 significant bits,
/// so it is exact in f32 and the GPU and the host agree on it bit for bit.
pub fn uniform(bits: u32) -> f32 {
    ((bits >> 9) as f32 + 0.5) * (1.0 / 8_388_608.0)
}

/// Standard Gumbel noise −ln(−ln u) of `token_bits(seed, index, vocab_id)`.
pub fn gumbel(seed: u64, index: u32, vocab_id: u32) -> f32 {
    gumbel_of_bits(token_bits(seed, index, vocab_id))
}

/// The noise of 32 random bits (only the top 23 count): the kernel's `gumbel_of_bits`.
pub fn gumbel_of_bits(bits: u32) -> f32 {
    gumbel_of(uniform(bits))
}

fn gumbel_of(u: f32) -> f32 {
    -ln(-ln(u))
}

/// At least any `gumbel` value: the noise of the largest uniform (the logarithm is non-decreasing
/// up to its rounding), with a margin far above that rounding.
pub fn gumbel_bound() -> f32 {
    gumbel_of_bits(u32::MAX) + 1e-3
}

/// ln(2) rounded to f32.
const LN_2: f32 = std::f32::consts::LN_2;

/// The natural logarithm of a positive normal f32 (what `gumbel_of` takes: 2^-24 to 17), within a
/// few ulps: x = m · 2^e with m in [√½, √2), and ln m = 2 atanh(s), s = (m − 1) / (m + 1), by its
/// series to s⁹ (|s| < 0.172, so the next term is below 2^-27 of the sum). Every operation is one
/// IEEE f32 operation in this order: the GPU's copy computes the same bits.
pub fn ln(x: f32) -> f32 {
    let bits = x.to_bits();
    let mut e = ((bits >> 23) & 0xff) as i32 - 127;
    let mut m = f32::from_bits((bits & 0x007f_ffff) | 0x3f80_0000); // [1, 2)
    if m > std::f32::consts::SQRT_2 {
        m *= 0.5; // exact
        e += 1;
    }
    let f = m - 1.0; // exact (Sterbenz: m is within a factor of 2 of 1)
    let s = f / (m + 1.0);
    let z = s * s;
    let series = z * (2.0 / 3.0 + z * (2.0 / 5.0 + z * (2.0 / 7.0 + z * (2.0 / 9.0))));
    (e as f32) * LN_2 + (2.0 * s + s * series)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn random123_known_answers() {
        assert_eq!(philox4x32_10([0; 4], [0; 2]), [0x6627_e8d5, 0xe169_c58d, 0xbc57_ac4c, 0x9b00_dbd8]);
        assert_eq!(philox4x32_10([u32::MAX; 4], [u32::MAX; 2]), [0x408f_276d, 0x41c8_3b0e, 0xa20b_c7c6, 0x6d54_51fd]);
        assert_eq!(
            philox4x32_10([0x243f_6a88, 0x85a3_08d3, 0x1319_8a2e, 0x0370_7344], [0xa409_3822, 0x299f_31d0]),
            [0xd16c_fe09, 0x94fd_cceb, 0x5001_e420, 0x2412_6ea1]
        );
    }

    #[test]
    fn uniform_stays_open_and_gumbel_finite() {
        assert!(uniform(0) > 0.0 && uniform(u32::MAX) < 1.0);
        for id in 0..2000 {
            let g = gumbel(7, 3, id);
            assert!(g.is_finite());
        }
        // Every input of the key and counter matters.
        let base = token_bits(1 << 40, 5, 9);
        assert_ne!(base, token_bits(1 << 41, 5, 9));
        assert_ne!(base, token_bits((1 << 40) | 1, 5, 9));
        assert_ne!(base, token_bits(1 << 40, 6, 9));
        assert_ne!(base, token_bits(1 << 40, 5, 10));
    }

    #[test]
    fn ln_is_within_a_few_ulps_of_the_true_logarithm_and_never_decreases() {
        // Every uniform the noise can see, strided, plus the ends and the √2 switch; and every
        // −ln(u) those give.
        let mut xs: Vec<f32> = (0..(1u32 << 23)).step_by(97).map(|b| uniform(b << 9)).collect();
        xs.extend([uniform(0), uniform(u32::MAX)]);
        let neg_ln: Vec<f32> = xs.iter().map(|&u| -ln(u)).collect();
        xs.extend(neg_ln);
        xs.extend([std::f32::consts::SQRT_2, 1.0, 2.0, 16.7]);
        for &x in &xs {
            // (No cancellation: |ln m| <= ln √2 is under half of any nonzero e · ln 2.)
            let (got, want) = (f64::from(ln(x)), f64::from(x).ln());
            assert!((got - want).abs() <= 4.0 * f64::from(f32::EPSILON) * want.abs(), "ln({x}) = {got}, want {want}");
        }
        xs.sort_by(f32::total_cmp);
        for w in xs.windows(2) {
            assert!(ln(w[0]) <= ln(w[1]), "ln({}) > ln({})", w[0], w[1]);
        }
    }

    #[test]
    fn gumbel_known_answers() {
        // Pinned: a change here changes every seeded stream (and must be made in the kernel's
        // copy too, which the GPU tests hold to this one).
        let got: Vec<u32> = [(0u64, 0u32, 0u32), (42, 7, 123_456), (u64::MAX, u32::MAX, 262_143)]
            .iter()
            .map(|&(s, i, v)| gumbel(s, i, v).to_bits())
            .collect();
        assert_eq!(got, GUMBEL_KNOWN);
    }

    const GUMBEL_KNOWN: [u32; 3] = [0x3dad_b63f, 0x3fe2_e075, 0x4005_ae11];

    #[test]
    fn uniform_is_roughly_uniform() {
        let n = 20_000;
        let mean: f64 = (0..n).map(|i| f64::from(uniform(token_bits(42, 0, i)))).sum::<f64>() / f64::from(n);
        assert!((mean - 0.5).abs() < 0.01, "mean {mean}");
    }
}
