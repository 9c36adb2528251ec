//! [`Shared`]: raw pointers handed to the parallel tasks of one kernel.

/// Operands (raw pointers, or tuples and plain structs of them) shared by the parallel tasks
/// of one kernel, each of which reads them and writes only its own part of the output.
/// Raw pointers are neither `Send` nor `Sync`; this wrapper is both, which is sound only
/// under the promise [`Shared::new`] asks of its caller.
#[derive(Clone, Copy)]
pub(crate) struct Shared<T: Copy>(T);

// SAFETY: `Shared::new`'s contract: every task only reads the shared memory or writes a part
// no other task touches, and all of it outlives the tasks.
unsafe impl<T: Copy> Send for Shared<T> {}
unsafe impl<T: Copy> Sync for Shared<T> {}

impl<T: Copy> Shared<T> {
    /// # Safety
    /// Every task the value reaches reads the memory behind it, or writes a part of it that
    /// no other task reads or writes, and that memory lives until the tasks are done.
    pub(crate) unsafe fn new(operands: T) -> Self {
        Self(operands)
    }

    /// The operands. A method rather than a field, so that a closure captures the whole
    /// (`Sync`) wrapper and not the pointers inside it.
    pub(crate) fn get(&self) -> T {
        self.0
    }
}
