//! Heap buffers aligned to 16 KiB: what O_DIRECT reads require and what a GPU can wrap (or, for
//! a read that lands straight in a mapped GPU slot, a view of that memory).

use std::alloc::{alloc_zeroed, dealloc, Layout};

pub const ALIGN: usize = 16 * 1024;

pub struct AlignedBuf {
    ptr: *mut u8,
    len: usize,
    /// Allocated here (freed on drop); false for memory lent by someone else (`borrowed`).
    owned: bool,
}

// SAFETY: the buffer is plain bytes owned by this value; no interior aliasing.
unsafe impl Send for AlignedBuf {}
unsafe impl Sync for AlignedBuf {}

impl AlignedBuf {
    /// `len` is rounded up to a multiple of 16 KiB. Returns None if the allocation fails (so
    /// a budget that overshoots free memory is an error, not an abort).
    pub fn new(len: usize) -> Option<Self> {
        let len = len.max(1).next_multiple_of(ALIGN);
        let layout = Layout::from_size_align(len, ALIGN).ok()?;
        // SAFETY: non-zero size, valid alignment.
        let ptr = unsafe { alloc_zeroed(layout) };
        (!ptr.is_null()).then_some(AlignedBuf {
            ptr,
            len,
            owned: true,
        })
    }

    /// A view of `len` bytes of memory owned elsewhere (a mapped GPU slot that a read lands in
    /// directly); never freed by this value.
    ///
    /// # Safety
    /// `ptr` must be valid for reads and writes of `len` bytes, and used by nobody else, for
    /// as long as the value (or anything reading through it) lives.
    pub unsafe fn borrowed(ptr: *mut u8, len: usize) -> Self {
        AlignedBuf {
            ptr,
            len,
            owned: false,
        }
    }

    /// Memory lent by someone else (`borrowed`): not for a pool or a cache.
    pub fn is_borrowed(&self) -> bool {
        !self.owned
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: ptr is valid for len bytes for our lifetime.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// The start of the buffer, for writers of disjoint ranges (the pieces of one blob read by
    /// several threads). The allocation does not move while `self` lives, wherever `self` goes.
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr
    }

    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and &mut self guarantees exclusivity.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

impl Drop for AlignedBuf {
    fn drop(&mut self) {
        if self.owned {
            // SAFETY: allocated in `new` with this exact layout.
            unsafe { dealloc(self.ptr, Layout::from_size_align_unchecked(self.len, ALIGN)) }
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn aligned_and_rounded() {
        let b = super::AlignedBuf::new(100).unwrap();
        assert_eq!(b.len(), 16384);
        assert_eq!(b.as_slice().as_ptr() as usize % 16384, 0);
        assert!(b.as_slice().iter().all(|&x| x == 0));
    }
}
