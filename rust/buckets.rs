//! Shape buckets: the fixed token counts a step is padded to, so XLA compiles a
//! bounded set of programs (one per bucket) instead of one per batch mix.

use crate::error::{KvError, KvResult};

/// Smallest default bucket: tiny steps all share one program.
pub const MIN_BUCKET: usize = 16;

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TokenBuckets {
    sizes: Vec<usize>,
}

impl TokenBuckets {
    /// Powers of two from 16 up to `max_batched_tokens`, which is always the last
    /// bucket (itself, when it is not a power of two).
    pub fn powers_of_two(max_batched_tokens: usize) -> Self {
        let mut sizes = Vec::new();
        let mut b = MIN_BUCKET;
        while b < max_batched_tokens {
            sizes.push(b);
            // Stop doubling before it wraps (max_batched_tokens near usize::MAX).
            match b.checked_mul(2) {
                Some(next) => b = next,
                None => break,
            }
        }
        sizes.push(max_batched_tokens);
        TokenBuckets { sizes }
    }

    /// A configured list: strictly increasing, positive, and the last one able to
    /// hold a full step (`max_batched_tokens`).
    pub fn from_list(sizes: Vec<usize>, max_batched_tokens: usize) -> KvResult<Self> {
        if sizes.is_empty() || sizes[0] == 0 {
            return Err(KvError::InvalidConfig(
                "token_buckets must be a non-empty list of positive sizes".into(),
            ));
        }
        if sizes.windows(2).any(|w| w[0] >= w[1]) {
            return Err(KvError::InvalidConfig(
                "token_buckets must be strictly increasing".into(),
            ));
        }
        let last = *sizes.last().expect("non-empty");
        if last < max_batched_tokens {
            return Err(KvError::InvalidConfig(format!(
                "the largest token bucket ({last}) must hold max_batched_tokens ({max_batched_tokens})"
            )));
        }
        Ok(TokenBuckets { sizes })
    }

    pub fn sizes(&self) -> &[usize] {
        &self.sizes
    }

    pub fn largest(&self) -> usize {
        *self.sizes.last().expect("non-empty")
    }

    /// The buckets up to the smallest one holding `reachable` tokens (all of
    /// them when none does): larger ones could never be used by a step that
    /// holds at most `reachable` tokens, so no buffer is sized for them.
    pub fn truncated(&self, reachable: usize) -> Self {
        let end = self.sizes.partition_point(|&b| b < reachable);
        TokenBuckets {
            sizes: self.sizes[..(end + 1).min(self.sizes.len())].to_vec(),
        }
    }

    /// These buckets with the largest one replaced by `size`, which must be
    /// larger than every other one.
    pub fn with_largest(&self, size: usize) -> Self {
        let mut sizes = self.sizes.clone();
        *sizes.last_mut().expect("non-empty") = size;
        debug_assert!(sizes.windows(2).all(|w| w[0] < w[1]));
        TokenBuckets { sizes }
    }

    /// The smallest bucket holding `tokens`; None if none does.
    pub fn fit(&self, tokens: usize) -> Option<usize> {
        let i = self.sizes.partition_point(|&b| b < tokens);
        self.sizes.get(i).copied()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_buckets() {
        assert_eq!(
            TokenBuckets::powers_of_two(2048).sizes(),
            &[16, 32, 64, 128, 256, 512, 1024, 2048]
        );
        assert_eq!(TokenBuckets::powers_of_two(100).sizes(), &[16, 32, 64, 100]);
        assert_eq!(TokenBuckets::powers_of_two(8).sizes(), &[8]);
        let b = TokenBuckets::powers_of_two(2048);
        assert_eq!(b.fit(0), Some(16));
        assert_eq!(b.fit(16), Some(16));
        assert_eq!(b.fit(17), Some(32));
        assert_eq!(b.fit(2048), Some(2048));
        assert_eq!(b.fit(2049), None);
    }

    #[test]
    fn powers_of_two_never_wrap_and_truncation_keeps_the_reachable_ones() {
        let b = TokenBuckets::powers_of_two(usize::MAX);
        assert_eq!(b.largest(), usize::MAX);
        assert_eq!(b.sizes()[b.sizes().len() - 2], 1 << (usize::BITS - 1));
        let t = TokenBuckets::powers_of_two(2048).truncated(1000);
        assert_eq!(t.sizes(), &[16, 32, 64, 128, 256, 512, 1024]);
        assert_eq!(
            TokenBuckets::powers_of_two(2048).truncated(1024).largest(),
            1024
        );
        assert_eq!(
            TokenBuckets::powers_of_two(2048).truncated(5000).largest(),
            2048
        );
    }

    #[test]
    fn configured_buckets_are_checked() {
        assert!(TokenBuckets::from_list(vec![], 64).is_err());
        assert!(TokenBuckets::from_list(vec![32, 16, 64], 64).is_err());
        assert!(TokenBuckets::from_list(vec![16, 32], 64).is_err());
        assert_eq!(
            TokenBuckets::from_list(vec![24, 100], 64).unwrap().fit(30),
            Some(100)
        );
    }
}
