//! Rotary position embedding tables, computed as transformers computes them (f32 inverse
//! frequencies, f32 angles), including YaRN's frequency blend and attention factor.

use smoe_vault::config::Rope;

pub struct RopeTable {
    half: usize,
    inv_freq: Vec<f32>,
    /// Multiplies cos and sin (YaRN's attention factor; 1 otherwise).
    scale: f32,
}

impl RopeTable {
    pub fn new(rope: &Rope, head_dim: usize) -> Self {
        let dim = head_dim;
        let half = dim / 2;
        let base = rope.theta;
        let pos_freqs: Vec<f32> = (0..half)
            .map(|i| base.powf((2 * i) as f64 / dim as f64) as f32)
            .collect();
        let extrapolation: Vec<f32> = pos_freqs.iter().map(|p| 1.0 / p).collect();
        let Some(y) = &rope.yarn else {
            return RopeTable {
                half,
                inv_freq: extrapolation,
                scale: 1.0,
            };
        };
        let interpolation: Vec<f32> = pos_freqs
            .iter()
            .map(|p| 1.0 / (y.factor as f32 * p))
            .collect();
        let correction_dim = |rot: f64| {
            dim as f64
                * (y.original_max_position_embeddings as f64 / (rot * 2.0 * std::f64::consts::PI))
                    .ln()
                / (2.0 * base.ln())
        };
        let (mut low, mut high) = (correction_dim(y.beta_fast), correction_dim(y.beta_slow));
        if y.truncate {
            low = low.floor();
            high = high.ceil();
        }
        let low = low.max(0.0);
        let mut high = high.min(dim as f64 - 1.0);
        if low == high {
            high += 0.001;
        }
        let inv_freq = (0..half)
            .map(|i| {
                let ramp = (((i as f32) - low as f32) / (high - low) as f32).clamp(0.0, 1.0);
                let extra = 1.0 - ramp;
                interpolation[i] * (1.0 - extra) + extrapolation[i] * extra
            })
            .collect();
        RopeTable {
            half,
            inv_freq,
            scale: y.attention_factor as f32,
        }
    }

    /// cos and sin (each `head_dim / 2` values) at `pos`.
    pub fn at(&self, pos: usize, cos: &mut [f32], sin: &mut [f32]) {
        for i in 0..self.half {
            let a = self.inv_freq[i] * pos as f32;
            cos[i] = (a as f64).cos() as f32 * self.scale;
            sin[i] = (a as f64).sin() as f32 * self.scale;
        }
    }

    pub fn half(&self) -> usize {
        self.half
    }

    /// The `head_dim / 2` inverse frequencies, for backends that compute the angles themselves.
    pub fn inv_freq(&self) -> &[f32] {
        &self.inv_freq
    }

    /// The factor on cos and sin (YaRN's attention factor; 1 otherwise).
    pub fn scale(&self) -> f32 {
        self.scale
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use smoe_vault::config::Yarn;

    #[test]
    fn default_rope_frequencies() {
        let t = RopeTable::new(
            &Rope {
                theta: 10000.0,
                yarn: None,
            },
            4,
        );
        assert_eq!(t.inv_freq, vec![1.0, 0.01]);
        let (mut c, mut s) = ([0.0; 2], [0.0; 2]);
        t.at(0, &mut c, &mut s);
        assert_eq!((c, s), ([1.0, 1.0], [0.0, 0.0]));
    }

    #[test]
    fn yarn_blends_between_interpolation_and_extrapolation() {
        let y = Yarn {
            factor: 4.0,
            original_max_position_embeddings: 64,
            beta_fast: 32.0,
            beta_slow: 1.0,
            attention_factor: 1.1386,
            truncate: true,
        };
        let plain = RopeTable::new(
            &Rope {
                theta: 1e6,
                yarn: None,
            },
            64,
        );
        let t = RopeTable::new(
            &Rope {
                theta: 1e6,
                yarn: Some(y),
            },
            64,
        );
        // High frequencies are kept, low ones divided by the factor.
        assert_eq!(t.inv_freq[0], plain.inv_freq[0]);
        assert!((t.inv_freq[31] - plain.inv_freq[31] / 4.0).abs() < 1e-12);
        assert_eq!(t.scale, 1.1386);
    }
}
