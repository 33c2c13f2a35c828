//! One kernel module loaded through the on-disk cache on its own (tests play several processes in
//! one with it).

/// Loads `source` as module `name` through the on-disk cache, bypassing the process's own module
/// table, checks that `function` is in it, and says how its code was obtained (so a test can play
/// several processes in one).
#[doc(hidden)]
pub fn probe_module_cache(
    device: crate::Device,
    name: &str,
    source: &str,
    function: &str,
) -> crate::Result<super::module_cache::ModuleSource> {
    let dev = super::device::dev_of(device)?;
    dev.bind()?;
    let (major, minor) = dev.ctx.compute_capability().map_err(|e| super::device::cu_err("compute capability", e))?;
    let m = super::module_cache::load_module(&dev.ctx, name, source, major, minor).map_err(crate::Error::Cuda)?;
    m.load_function(function).map_err(|e| super::device::cu_err(&format!("kernel {function} in module {name}"), e))?;
    super::module_cache::module_reports()
        .iter()
        .rev()
        .find(|r| r.name == name)
        .map(|r| r.source)
        .ok_or_else(|| crate::Error::Cuda(format!("module {name}: no load report")))
}
