//! The error of the environment variables that switch parts of the model code
//! (`UPSCALE_CUDA_OFF`, `UPSCALE_PAD_CHANNELS`), and the per-thread override that lets a test
//! run both settings of a switch in one process.

pub mod cuda_off;

/// Runs `f` with `value` in `slot` (a switch's thread-local override) on this thread, then
/// puts back what was there, even if `f` panics. Setting the variable instead would race the
/// other tests of the process.
#[cfg(test)]
pub(crate) fn with_override<T: Copy + 'static, R>(
    slot: &'static std::thread::LocalKey<std::cell::Cell<Option<T>>>,
    value: T,
    f: impl FnOnce() -> R,
) -> R {
    type Slot<T> = std::thread::LocalKey<std::cell::Cell<Option<T>>>;
    struct Restore<T: Copy + 'static>(&'static Slot<T>, Option<T>);
    impl<T: Copy + 'static> Drop for Restore<T> {
        fn drop(&mut self) {
            self.0.with(|o| o.set(self.1));
        }
    }
    let _restore = Restore(slot, slot.with(|o| o.replace(Some(value))));
    f()
}

/// A value one of the variables does not take; the message names the variable.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum EnvError {
    /// The value is not UTF-8.
    #[error("{var} is not valid UTF-8")]
    NotUnicode {
        /// The variable.
        var: &'static str,
    },
    /// A part of the list that the variable does not know.
    #[error("{var}: unknown part '{part}' (expected {expected})")]
    UnknownPart {
        /// The variable.
        var: &'static str,
        /// The part, as written.
        part: String,
        /// The parts it knows.
        expected: &'static str,
    },
    /// A number that is not one of the channel multiples.
    #[error("{var}: {value} is not a channel multiple (expected 0, 8, 16 or 64)")]
    NotAMultiple {
        /// The variable.
        var: &'static str,
        /// The number.
        value: usize,
    },
    /// A value that is no number at all.
    #[error("{var}: '{value}' is not a channel multiple (expected 0, 8, 16 or 64)")]
    NotANumber {
        /// The variable.
        var: &'static str,
        /// The value, trimmed.
        value: String,
    },
}
