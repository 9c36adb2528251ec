//! A synthetic input and the process's peak memory: what the engine measures its per-pixel
//! cost with, and what `upscale bench` runs on.

use crate::planar::Planar;

/// A deterministic test pattern (smooth gradients plus a hashed texture), so runs are
/// comparable without shipping an image.
pub fn pattern(height: usize, width: usize) -> Planar {
    let mut data = Vec::with_capacity(3 * height * width);
    for c in 0..3 {
        for y in 0..height {
            for x in 0..width {
                let h = (x as u32).wrapping_mul(73_856_093)
                    ^ (y as u32).wrapping_mul(19_349_663)
                    ^ (c as u32).wrapping_mul(83_492_791);
                let noise = (h % 1000) as f32 / 1000.0;
                let smooth =
                    0.5 + 0.4 * ((x as f32 * 0.05 + c as f32).sin() * (y as f32 * 0.031).cos());
                data.push((0.8 * smooth + 0.2 * noise).clamp(0.0, 1.0));
            }
        }
    }
    Planar::new(3, height, width, data)
}

/// Restarts the kernel's high-water mark of resident memory from the current usage, so that
/// [`peak_rss_bytes`] reports the peak of what runs next (Linux only; `None` elsewhere).
pub fn reset_peak_rss() -> Option<()> {
    std::fs::write("/proc/self/clear_refs", "5").ok()
}

/// Peak resident memory of this process, from the kernel's high-water mark.
pub fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}
