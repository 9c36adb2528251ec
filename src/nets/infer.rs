//! Configuration inference: the error every architecture's inference returns, and the
//! reading of tensor shapes that several of them share (the Swin-family group layout, the
//! pixel-shuffle upsampler, the check that every tensor is explained).

pub(crate) use crate::nets::registry::Shapes;

/// Why a state dict's tensors do not make a model this build runs: found by config inference,
/// before any layer is built. The messages name the tensor where there is one.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// A tensor the architecture needs is not in the file.
    #[error("missing tensor {name}{hint}")]
    Missing {
        /// The tensor's state-dict key.
        name: String,
        /// What its absence suggests, with its leading space ("" when nothing).
        hint: &'static str,
    },
    /// A tensor that no part of the inferred configuration explains.
    #[error("unexpected tensor {name}{hint}")]
    Unexpected {
        /// The tensor's state-dict key.
        name: String,
        /// What its presence suggests, with its leading space ("" when nothing).
        hint: &'static str,
    },
    /// A tensor whose shape does not fit.
    #[error("tensor {name} has shape {shape:?}{expected}")]
    Shape {
        /// The tensor's state-dict key.
        name: String,
        /// Its shape in the file.
        shape: Vec<usize>,
        /// What would fit, with its leading separator ("" when the shape says enough).
        expected: String,
    },
    /// A window-attention bias table whose rows are no (2 * window - 1)².
    #[error("tensor {name} has {rows} rows; expected (2*window-1)^2")]
    WindowRows {
        /// The table's state-dict key.
        name: String,
        /// Its rows.
        rows: usize,
    },
    /// A block whose width its head count does not divide.
    #[error("block {block} has width {width} and {heads} heads: the width must divide evenly")]
    Heads {
        /// The block's key prefix (`layers.G.swinK`).
        block: String,
        /// Its channels.
        width: usize,
        /// Its heads.
        heads: usize,
    },
    /// No `layers.N.*` tensors at all.
    #[error("no residual groups (layers.N.*) found: not a DRCT checkpoint")]
    NoGroups,
    /// Pixel-shuffle stages that multiply to a scale the network does not have.
    #[error("unsupported upsampler: scale {scale} from {stages} stages")]
    Upsampler {
        /// The product of the stages.
        scale: usize,
        /// How many there are.
        stages: usize,
    },
    /// A variant of a supported architecture that this build does not run.
    #[error("{0} is not supported")]
    Unsupported(&'static str),
    /// The tensors are of an architecture this build does not load.
    #[error("{found}: this build loads {supported}")]
    OtherArchitecture {
        /// What the keys look like (`a Swin2SR checkpoint (...)`).
        found: String,
        /// The architectures this build loads.
        supported: String,
    },
    /// A SwinIR or HAT model whose input is not RGB.
    #[error("a {arch} model with {channels} input channels: only RGB models (3) are supported")]
    NotRgb {
        /// The architecture.
        arch: &'static str,
        /// Its input channels.
        channels: usize,
    },
    /// SwinIR's 3conv residual connection on a width it cannot quarter.
    #[error("the 3conv residual connection needs a width divisible by 4, not {0}")]
    ThreeConvWidth(usize),
    /// SwinIR's one-step pixel shuffle with outputs that are not 3 x scale².
    #[error(
        "tensor upsample.0.weight has {0} outputs: not 3 x scale^2 (a one-step pixel shuffle)"
    )]
    DirectUpsampler(usize),
    /// A SwinIR model with neither an upsampler nor the restoration models' `conv_last`.
    #[error(
        "no upsampler (conv_before_upsample, upsample.0) and no conv_last: not a SwinIR \
         super-resolution, denoising or JPEG model"
    )]
    NoUpsampler,
    /// A residual group with no Swin blocks.
    #[error("residual group layers.{0} has no Swin blocks (layers.{0}.residual_group.blocks.N)")]
    EmptyGroup(usize),
    /// No `layers.N.*` tensors in a SwinIR or HAT checkpoint.
    #[error("no residual groups (layers.N.*) found")]
    NoSwinGroups,
    /// HAT's overlap window leaves odd margins around its window.
    #[error("overlap window {overlap} around a window of {window}: the margins must be even")]
    OverlapMargins {
        /// The overlap window's side.
        overlap: usize,
        /// The window's side.
        window: usize,
    },
    /// A HAT checkpoint that does not fit HAT's configuration.
    #[error("HAT checkpoint: {0}")]
    Hat(#[source] Box<ConfigError>),
    /// An RRDBNet whose unshuffled input its upsampling steps cannot bring back to size.
    #[error(
        "an input pixel-unshuffled by {unshuffle} and {upsamples} x2 upsampling steps: \
         the network would shrink its input"
    )]
    UnshuffleScale {
        /// The unshuffle factor read from the channels.
        unshuffle: usize,
        /// The upsampling convolutions.
        upsamples: usize,
    },
    /// An ESRGAN checkpoint that does not fit RRDBNet's configuration.
    #[error("ESRGAN checkpoint: {0}")]
    Esrgan(#[source] Box<ConfigError>),
    /// A Real-ESRGAN Compact checkpoint that does not fit SRVGGNetCompact's configuration.
    #[error("Compact checkpoint: {0}")]
    Compact(#[source] Box<ConfigError>),
    /// A SPAN checkpoint that does not fit SPAN's configuration.
    #[error("SPAN checkpoint: {0}")]
    Span(#[source] Box<ConfigError>),
    /// A tensor whose values do not fit (DAT's position grids).
    #[error("tensor {name} {problem}")]
    Values {
        /// The tensor's state-dict key.
        name: String,
        /// What is wrong with its values.
        problem: String,
    },
    /// A DAT checkpoint that does not fit DAT's configuration.
    #[error("DAT checkpoint: {0}")]
    Dat(#[source] Box<ConfigError>),
    /// A Swin2SR checkpoint that does not fit Swin2SR's configuration.
    #[error("Swin2SR checkpoint: {0}")]
    Swin2Sr(#[source] Box<ConfigError>),
    /// A Swin2SR file without the buffers that alone record its window.
    #[error(
        "no relative_position_index buffer: a Swin2SR file records its window only there (an \
         official checkpoint has it; a file converted by `upscale convert` keeps it in its \
         metadata)"
    )]
    NoWindow,
    /// A SwinIR checkpoint that does not fit SwinIR's configuration.
    #[error("SwinIR checkpoint: {0}")]
    SwinIr(#[source] Box<ConfigError>),
    /// A RealPLKSR checkpoint that does not fit RealPLKSR's configuration.
    #[error("RealPLKSR checkpoint: {0}")]
    Plksr(#[source] Box<ConfigError>),
    /// An OmniSR checkpoint that does not fit OmniSR's configuration.
    #[error("OmniSR checkpoint: {0}")]
    OmniSr(#[source] Box<ConfigError>),
    /// A Real-CUGAN checkpoint that does not fit any of its forms.
    #[error("Real-CUGAN checkpoint: {0}")]
    RealCugan(#[source] Box<ConfigError>),
    /// An RCAN checkpoint that does not fit RCAN's configuration.
    #[error("RCAN checkpoint: {0}")]
    Rcan(#[source] Box<ConfigError>),
    /// A MoSR checkpoint that does not fit MoSR's configuration.
    #[error("MoSR checkpoint: {0}")]
    Mosr(#[source] Box<ConfigError>),
    /// An FDAT checkpoint that does not fit FDAT's configuration.
    #[error("FDAT checkpoint: {0}")]
    Fdat(#[source] Box<ConfigError>),
    /// A SAFMN checkpoint that does not fit SAFMN's configuration.
    #[error("SAFMN checkpoint: {0}")]
    Safmn(#[source] Box<ConfigError>),
}

impl ConfigError {
    pub(crate) fn missing(name: &str, hint: &'static str) -> Self {
        Self::Missing {
            name: name.to_string(),
            hint,
        }
    }

    pub(crate) fn shape(name: &str, shape: &[usize], expected: impl Into<String>) -> Self {
        Self::Shape {
            name: name.to_string(),
            shape: shape.to_vec(),
            expected: expected.into(),
        }
    }
}

/// What SwinIR and HAT checkpoints share: blocks per residual group
/// (`layers.i.residual_group.blocks.j`), the window (from the first block's relative position
/// table) and each group's heads, which must divide the width `embed_dim`.
pub(crate) struct SwinLayout {
    pub depths: Vec<usize>,
    pub window: usize,
    pub heads: Vec<usize>,
}

/// [`SwinLayout`] read from the tensor shapes, or what is wrong with them.
pub(crate) fn swin_layout(
    shapes: &Shapes,
    embed_dim: usize,
) -> std::result::Result<SwinLayout, ConfigError> {
    let depths = swin_depths(shapes)?;
    let block0 = "layers.0.residual_group.blocks.0";
    let table_name = format!("{block0}.attn.relative_position_bias_table");
    let table = tensor(shapes, &table_name)?;
    let side = if table.len() == 2 { isqrt(table[0]) } else { 0 };
    if table.len() != 2 || side * side != table[0] || side % 2 == 0 {
        return Err(ConfigError::shape(
            &table_name,
            table,
            "; expected [(2*window-1)^2, heads]",
        ));
    }
    let window = side.div_ceil(2);
    let mut heads = Vec::with_capacity(depths.len());
    for i in 0..depths.len() {
        let name = format!("layers.{i}.residual_group.blocks.0.attn.relative_position_bias_table");
        let t = tensor(shapes, &name)?;
        let h = t.get(1).copied().unwrap_or(0);
        if h == 0 || !embed_dim.is_multiple_of(h) {
            return Err(ConfigError::shape(
                &name,
                t,
                format!(": {h} heads do not divide the width {embed_dim}"),
            ));
        }
        heads.push(h);
    }
    Ok(SwinLayout {
        depths,
        window,
        heads,
    })
}

/// Blocks per residual group (`layers.i.residual_group.blocks.j`) of a Swin-family
/// checkpoint; refused with an absolute position embedding, which ties a model to the size it
/// was trained at.
pub(crate) fn swin_depths(shapes: &Shapes) -> std::result::Result<Vec<usize>, ConfigError> {
    if shapes.contains_key("absolute_pos_embed") {
        return Err(ConfigError::Unsupported(
            "absolute position embedding (ape=True)",
        ));
    }
    let mut depths: Vec<usize> = Vec::new();
    for key in shapes.keys() {
        let Some(rest) = key.strip_prefix("layers.") else {
            continue;
        };
        let mut parts = rest.split('.');
        let i: usize =
            parts
                .next()
                .and_then(|i| i.parse().ok())
                .ok_or_else(|| ConfigError::Unexpected {
                    name: key.clone(),
                    hint: "",
                })?;
        if depths.len() <= i {
            depths.resize(i + 1, 0);
        }
        if parts.next() == Some("residual_group") && parts.next() == Some("blocks") {
            let j: usize = parts.next().and_then(|j| j.parse().ok()).ok_or_else(|| {
                ConfigError::Unexpected {
                    name: key.clone(),
                    hint: "",
                }
            })?;
            depths[i] = depths[i].max(j + 1);
        }
    }
    if let Some(i) = depths.iter().position(|&d| d == 0) {
        return Err(ConfigError::EmptyGroup(i));
    }
    if depths.is_empty() {
        return Err(ConfigError::NoSwinGroups);
    }
    Ok(depths)
}

/// The product of the classical upsampler's pixel-shuffle stages (`upsample.0`, `.2`, ...).
pub(crate) fn pixel_shuffle_scale(
    shapes: &Shapes,
    f: usize,
) -> std::result::Result<usize, ConfigError> {
    let mut scale = 1;
    let mut stage = 0;
    while let Some(w) = shapes.get(&format!("upsample.{}.weight", 2 * stage)) {
        let out = w.first().copied().unwrap_or(0);
        let r = isqrt(out / f.max(1));
        if w.len() != 4 || r * r * f != out || !(r == 2 || r == 3) {
            return Err(ConfigError::shape(
                &format!("upsample.{}.weight", 2 * stage),
                w,
                format!(": not a pixel-shuffle stage of 2 or 3 over {f} channels"),
            ));
        }
        scale *= r;
        stage += 1;
    }
    if stage == 0 {
        return Err(ConfigError::missing("upsample.0.weight", ""));
    }
    if !(scale == 3 || (scale.is_power_of_two() && scale >= 2)) || (scale % 3 == 0 && stage > 1) {
        return Err(ConfigError::Upsampler {
            scale,
            stages: stage,
        });
    }
    Ok(scale)
}

/// Every expected tensor present with its exact shape, and nothing unexplained left over.
pub(crate) fn check_shapes(
    expected: &[(String, Vec<usize>)],
    shapes: &Shapes,
    unexpected: &'static str,
) -> std::result::Result<(), ConfigError> {
    for (name, shape) in expected {
        let found = tensor(shapes, name)?;
        if found != shape {
            return Err(ConfigError::shape(
                name,
                found,
                format!(" but the inferred config needs {shape:?}"),
            ));
        }
    }
    if expected.len() != shapes.len() {
        let known: std::collections::HashSet<&str> =
            expected.iter().map(|(n, _)| n.as_str()).collect();
        if let Some(extra) = shapes.keys().find(|k| !known.contains(k.as_str())) {
            return Err(ConfigError::Unexpected {
                name: extra.clone(),
                hint: unexpected,
            });
        }
    }
    Ok(())
}

/// The factors of a classical upsampler's pixel-shuffle stages for `scale`: one stage of 3,
/// or stages of 2.
pub(crate) fn pixel_shuffle_stages(scale: usize) -> Vec<usize> {
    if scale == 3 {
        vec![3]
    } else {
        vec![2; scale.trailing_zeros() as usize]
    }
}

/// The parameters that tensors of these shapes hold.
pub(crate) fn parameters(tensors: &[(String, Vec<usize>)]) -> usize {
    tensors
        .iter()
        .map(|(_, s)| s.iter().product::<usize>())
        .sum()
}

/// What [`check_shapes`] adds to an unexpected tensor's name.
pub(crate) const UNEXPECTED_SWINIR: &str =
    " (an unsupported SwinIR variant or another architecture)";

/// The shape of tensor `name`.
pub(crate) fn tensor<'a>(
    shapes: &'a Shapes,
    name: &str,
) -> std::result::Result<&'a [usize], ConfigError> {
    shapes
        .get(name)
        .map(Vec::as_slice)
        .ok_or_else(|| ConfigError::missing(name, ""))
}

/// The output width (first axis) of weight `name`.
pub(crate) fn out_width(shapes: &Shapes, name: &str) -> std::result::Result<usize, ConfigError> {
    let s = tensor(shapes, name)?;
    match s.first() {
        Some(&n) if n > 0 && s.len() >= 2 => Ok(n),
        _ => Err(ConfigError::shape(name, s, "; expected a non-empty weight")),
    }
}

pub(crate) fn isqrt(n: usize) -> usize {
    let mut r = (n as f64).sqrt() as usize;
    while r * r > n {
        r -= 1;
    }
    while (r + 1) * (r + 1) <= n {
        r += 1;
    }
    r
}
