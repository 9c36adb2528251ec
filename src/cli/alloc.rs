//! The tool's allocator: the system's, asking Linux for transparent huge pages on the 2 MiB
//! pages inside every large block.
//!
//! A forward pass touches its activations' memory for the first time on every image that is
//! larger than the ones before, and each 4 KiB page costs a fault (about 2 µs on the VMs we
//! measure on): Real-CUGAN x2 at 128x128 took 36k of them in a 0.39 s process. With huge
//! pages the same run takes about 4k, and a whole process 1.18-1.24x less time. Where the
//! kernel gives huge pages only on request (`madvise`, common), this is the request; where it
//! never gives them, the advice is refused and nothing changes. `UPSCALE_HUGE_PAGES=0` leaves
//! it out.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicBool, Ordering};

/// Blocks from this size up get the advice: below it, a block holds at most one whole huge
/// page.
const LARGE: usize = 4 << 20;
/// The x86-64 and arm64 (4 KiB base) huge page.
const HUGE_PAGE: usize = 2 << 20;

static ADVISE: AtomicBool = AtomicBool::new(true);

/// The system allocator with the advice above.
pub(crate) struct HugePages;

impl HugePages {
    /// Whether large blocks get the advice from now on (`UPSCALE_HUGE_PAGES`).
    pub(crate) fn set(on: bool) {
        ADVISE.store(on, Ordering::Relaxed);
    }
}

/// Asks for huge pages on the whole 2 MiB pages inside the block at `p` of `size` bytes;
/// whether the kernel took the advice.
pub(crate) fn advise(p: *mut u8, size: usize) -> bool {
    #[cfg(target_os = "linux")]
    if !p.is_null() && size >= LARGE && ADVISE.load(Ordering::Relaxed) {
        let start = (p as usize).next_multiple_of(HUGE_PAGE);
        let end = (p as usize + size) / HUGE_PAGE * HUGE_PAGE;
        if end > start {
            // SAFETY: advice only (no data changes), on whole pages of a block the system
            // allocator has just handed out.
            let r = unsafe {
                libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE)
            };
            return r == 0;
        }
    }
    let _ = (p, size);
    false
}

// SAFETY: every block comes from and goes back to the system allocator, unchanged; the advice
// only changes how the kernel backs its pages.
unsafe impl GlobalAlloc for HugePages {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded to the caller.
        let p = unsafe { System.alloc(layout) };
        advise(p, layout.size());
        p
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if layout.size() < LARGE {
            // SAFETY: forwarded to the caller.
            return unsafe { System.alloc_zeroed(layout) };
        }
        // The advice before the zeros, so that they are written into huge pages.
        // SAFETY: forwarded to the caller; the block holds layout.size() bytes.
        unsafe {
            let p = System.alloc(layout);
            if !p.is_null() {
                advise(p, layout.size());
                p.write_bytes(0, layout.size());
            }
            p
        }
    }

    unsafe fn dealloc(&self, p: *mut u8, layout: Layout) {
        // SAFETY: forwarded to the caller.
        unsafe { System.dealloc(p, layout) }
    }

    unsafe fn realloc(&self, p: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: forwarded to the caller.
        let q = unsafe { System.realloc(p, layout, new_size) };
        advise(q, new_size);
        q
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A large block of this process (whose allocator this is) lies in memory the kernel
    /// marks for huge pages (`hg` in its smaps flags), wherever the kernel has them; a small
    /// one is left alone.
    #[test]
    fn large_blocks_are_marked_for_huge_pages() {
        let thp = std::path::Path::new("/sys/kernel/mm/transparent_hugepage/enabled");
        if !cfg!(target_os = "linux") || !thp.exists() {
            eprintln!("no transparent huge pages on this system: nothing to check");
            return;
        }
        let block = vec![1u8; 16 << 20];
        let small = vec![1u8; 64 << 10];
        let flags = |addr: usize| -> String {
            let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
            let mut inside = false;
            for line in smaps.lines() {
                let first = line.split_whitespace().next().unwrap_or("");
                if let Some((a, b)) = first.split_once('-') {
                    if let (Ok(a), Ok(b)) =
                        (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16))
                    {
                        inside = a <= addr && addr < b;
                        continue;
                    }
                }
                if inside {
                    if let Some(f) = line.strip_prefix("VmFlags:") {
                        return f.to_string();
                    }
                }
            }
            panic!("no mapping holds {addr:#x}");
        };
        let middle = block.as_ptr() as usize + (8 << 20);
        let f = flags(middle);
        assert!(f.split_whitespace().any(|x| x == "hg"), "{f}");
        assert!(
            !advise(small.as_ptr().cast_mut(), small.len()),
            "a small block was advised"
        );
        drop((block, small));
    }
}
