//! The `upscale` command-line tool, built on the `upscale` library's public API (see
//! [`cli`]).

use std::process::ExitCode;

mod cli;

#[global_allocator]
static ALLOCATOR: cli::alloc::HugePages = cli::alloc::HugePages;

/// Keep freed activation buffers in the process instead of returning them to the kernel:
/// every layer allocates fresh tensors of the same few sizes, and glibc's default of mapping
/// each large block anew costs page faults on every one of them.
fn keep_freed_memory() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only adjusts allocator tunables; called before any other thread exists.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 1 << 30);
        libc::mallopt(libc::M_TRIM_THRESHOLD, i32::MAX);
    }
}

/// Die quietly on a closed pipe (`upscale ... --json | head -1`), as Unix tools do, instead
/// of failing a print.
fn default_sigpipe() {
    #[cfg(unix)]
    // SAFETY: restoring the default disposition of one signal before any thread exists.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

/// `UPSCALE_HUGE_PAGES=0` (or `off`, `false`) leaves out the huge-page advice ([`cli::alloc`]).
fn huge_pages_switch() {
    if let Ok(v) = std::env::var("UPSCALE_HUGE_PAGES") {
        let off = matches!(
            v.trim().to_ascii_lowercase().as_str(),
            "0" | "off" | "false"
        );
        cli::alloc::HugePages::set(!off);
    }
}

fn main() -> ExitCode {
    huge_pages_switch();
    keep_freed_memory();
    default_sigpipe();
    cli::main()
}
