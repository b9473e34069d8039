//! Page ids and the pool's shape: what every module that handles pages
//! shares, below the pool and the prefix cache's naming alike.
//!
//! `PageId` is the integer type a page id travels in, `BlockSize` the tokens
//! per page with the division hot loops need, `validate_shape` the checks on
//! a pool's size, and `resident` how the per-page arrays are allocated.

use crate::error::{KvError, KvResult};

/// The null / padding page id.
pub const NULL_PAGE: u32 = 0;

/// Integer types page ids travel in: u32 inside the core, int32 in numpy arrays.
pub trait PageId: Copy {
    fn from_page(page: u32) -> Self;
    fn to_i64(self) -> i64;
}

macro_rules! page_id {
    ($($t:ty),*) => {$(
        impl PageId for $t {
            #[inline]
            fn from_page(page: u32) -> Self {
                page as $t
            }
            #[inline]
            fn to_i64(self) -> i64 {
                self as i64
            }
        }
    )*};
}
page_id!(u32, i32, i64);

/// Tokens per page, with the division a hot loop needs: a shift and a mask when
/// the size is a power of two (the usual case), a real division otherwise.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BlockSize {
    size: usize,
    /// log2(size) when size is a power of two, else u32::MAX.
    shift: u32,
}

impl BlockSize {
    pub fn new(size: usize) -> Self {
        let shift = if size.is_power_of_two() {
            size.trailing_zeros()
        } else {
            u32::MAX
        };
        BlockSize { size, shift }
    }

    #[inline]
    pub fn get(self) -> usize {
        self.size
    }

    /// (page index, offset in the page) of token position `pos`.
    #[inline]
    pub fn split(self, pos: usize) -> (usize, usize) {
        if self.shift != u32::MAX {
            (pos >> self.shift, pos & (self.size - 1))
        } else {
            (pos / self.size, pos % self.size)
        }
    }

    /// Pages needed to hold `tokens` tokens.
    #[inline]
    pub fn blocks_for(self, tokens: usize) -> usize {
        if self.shift != u32::MAX {
            (tokens + self.size - 1) >> self.shift
        } else {
            tokens.div_ceil(self.size)
        }
    }
}

/// Checks on a pool's shape, shared by `BlockPool::new` and the scheduler's config.
///
/// Slots (`page * block_size + offset`) are int32 in the step plan, and the
/// padding slot `num_blocks * block_size` must be representable too.
pub fn validate_shape(num_blocks: usize, block_size: usize) -> KvResult<()> {
    if num_blocks < 2 {
        return Err(KvError::InvalidConfig(format!(
            "num_blocks must be at least 2 (page 0 is the null page), got {num_blocks}"
        )));
    }
    if block_size == 0 {
        return Err(KvError::InvalidConfig(
            "block_size must be at least 1".into(),
        ));
    }
    if (num_blocks as u128) * (block_size as u128) > i32::MAX as u128 {
        return Err(KvError::InvalidConfig(format!(
            "num_blocks * block_size = {} does not fit the int32 slot ids of the step plan",
            num_blocks as u128 * block_size as u128
        )));
    }
    Ok(())
}

/// `vec![value; n]`, allocated fallibly, with every memory page of it written
/// now.
///
/// The per-page arrays are sized for the whole pool at start-up, and a
/// zero-filled one comes from the allocator as untouched memory that the
/// kernel maps on first write, page by page: without this, the first pass of
/// a running scheduler through each array pays a page fault every 4 KiB
/// (every 256 names, 1,024 refcounts), a few microseconds each, in the middle
/// of its steps. Written here, they are paid once, while the pool is built.
///
/// An array the process cannot hold is an error for the caller to report
/// (`try_reserve_exact`), never the global allocator's abort.
pub(crate) fn resident<T: Copy>(
    n: usize,
    value: T,
) -> Result<Vec<T>, std::collections::TryReserveError> {
    let mut v = Vec::new();
    v.try_reserve_exact(n)?;
    v.resize(n, value);
    let stride = (4096 / std::mem::size_of::<T>().max(1)).max(1);
    for i in (0..n).step_by(stride) {
        // An opaque value: the store cannot be elided (nor the fill above
        // turned into a zeroed allocation nobody writes), so the page is mapped.
        v[i] = std::hint::black_box(value);
    }
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_size_math_matches_division() {
        for size in [1usize, 3, 8, 16, 24, 64] {
            let b = BlockSize::new(size);
            for pos in 0..200 {
                assert_eq!(b.split(pos), (pos / size, pos % size));
                assert_eq!(b.blocks_for(pos), pos.div_ceil(size));
            }
        }
    }
}
