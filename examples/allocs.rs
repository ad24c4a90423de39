//! The idemproxy binary with its allocations counted: every `alloc` and `realloc` of the
//! process (serving threads, the store's writer, the auditor) goes through a counter before
//! mimalloc. `bench/allocs.sh` reads the count before and after a workload and divides by the
//! requests served: allocations per request, beside a passthrough's.
//!
//! Usage: as the `idemproxy` binary (`serve --config F`), with `IDEMPROXY_ALLOC_FILE=PATH`:
//! the count is written there every 50 ms.

use std::alloc::{GlobalAlloc, Layout};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

struct Counting;

static CALLS: AtomicU64 = AtomicU64::new(0);
static BYTES: AtomicU64 = AtomicU64::new(0);

// SAFETY: every call is passed on to mimalloc unchanged; the counters only add to atomics.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        CALLS.fetch_add(1, Relaxed);
        BYTES.fetch_add(layout.size() as u64, Relaxed);
        // SAFETY: the caller's contract for `alloc`, passed on.
        unsafe { mimalloc::MiMalloc.alloc(layout) }
    }
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        CALLS.fetch_add(1, Relaxed);
        BYTES.fetch_add(layout.size() as u64, Relaxed);
        // SAFETY: the caller's contract for `alloc_zeroed`, passed on.
        unsafe { mimalloc::MiMalloc.alloc_zeroed(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract for `dealloc`, passed on.
        unsafe { mimalloc::MiMalloc.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        CALLS.fetch_add(1, Relaxed);
        BYTES.fetch_add(new_size as u64, Relaxed);
        // SAFETY: the caller's contract for `realloc`, passed on.
        unsafe { mimalloc::MiMalloc.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn main() -> std::process::ExitCode {
    if let Some(path) = std::env::var_os("IDEMPROXY_ALLOC_FILE") {
        std::thread::spawn(move || loop {
            let line = format!("{} {}\n", CALLS.load(Relaxed), BYTES.load(Relaxed));
            let _ = std::fs::write(&path, line);
            std::thread::sleep(std::time::Duration::from_millis(50));
        });
    }
    idemproxy::cli::main()
}
