//! The architectures this build loads, one entry each: how its tensor names are told apart
//! from the others', and its configuration read from the names and shapes. Adding an
//! architecture is its own module under `nets/` and one line in [`REGISTRY`].

use std::collections::BTreeMap;

use super::{
    compact, dat, drct, esrgan, fdat, hat, mosr, omnisr, plksr, rcan, realcugan, safmn, span,
    swin2sr, swinir, ArchConfig, ConfigError,
};

/// A state dict's tensor names and shapes.
pub(crate) type Shapes = BTreeMap<String, Vec<usize>>;

/// A state dict's tensor values by name, flattened, for the few configurations that a shape
/// does not tell (DAT's window height from its width); `None` for a tensor it lacks.
pub(crate) type Values<'a> = &'a dyn Fn(&str) -> Option<Vec<f32>>;

/// What a file tells beyond its parameters' names and shapes, for the few configurations
/// those leave open.
pub(crate) struct Beyond<'a> {
    /// The parameters' values ([`Values`]).
    pub values: Values<'a>,
    /// The shapes of the buffers loading dropped: Swin2SR records its window only there.
    pub buffers: &'a Shapes,
    /// The configuration `upscale convert` wrote into the file's metadata (JSON), if any:
    /// what a converted file, its buffers gone, still says of them.
    pub stored: Option<&'a str>,
}

/// One architecture the registry holds.
pub(crate) trait Architecture: Sync {
    /// Its name (`"DRCT"`).
    fn name(&self) -> &'static str;

    /// What of it loads, for the line that lists the registry (`"x2/x3/x4"`, or the
    /// variants); empty when the name says enough.
    fn loads(&self) -> &'static str;

    /// Whether the tensor names are this architecture's. At most one entry may answer yes
    /// for any state dict.
    fn detect(&self, shapes: &Shapes) -> bool;

    /// Its configuration, read from the tensors, with every tensor checked against it.
    fn infer(&self, shapes: &Shapes) -> Result<ArchConfig, ConfigError>;

    /// [`Self::infer`] with the rest of the file at hand, for an architecture that reads some.
    fn infer_with(&self, shapes: &Shapes, _beyond: &Beyond) -> Result<ArchConfig, ConfigError> {
        self.infer(shapes)
    }
}

/// Every architecture this build loads, in the order messages list them.
pub(crate) const REGISTRY: &[&dyn Architecture] = &[
    &drct::Arch,
    &swinir::Arch,
    &swin2sr::Arch,
    &hat::Arch,
    &esrgan::Arch,
    &compact::Arch,
    &span::Arch,
    &dat::Arch,
    &plksr::Arch,
    &plksr::OriginalArch,
    &omnisr::Arch,
    &realcugan::Arch,
    &rcan::Arch,
    &mosr::Arch,
    &fdat::Arch,
    &safmn::Arch,
];

/// The architecture whose configuration inference explains a state dict none recognises
/// but that has a `conv_first`: DRCT's, whose errors name the first missing tensor (a
/// truncated or renamed DRCT file is the likeliest such file).
const FALLBACK: &dyn Architecture = &drct::Arch;

/// The architecture of a state dict and its configuration, every tensor checked, from the
/// shapes alone.
#[cfg(test)]
pub(crate) fn infer(shapes: &Shapes) -> Result<ArchConfig, ConfigError> {
    infer_with(shapes, &|_| None)
}

/// The architecture of a state dict and its configuration, every tensor checked; `values`
/// gives the tensors' values where a shape does not tell enough.
#[cfg(test)]
pub(crate) fn infer_with(shapes: &Shapes, values: Values) -> Result<ArchConfig, ConfigError> {
    let buffers = Shapes::new();
    infer_file(
        shapes,
        &Beyond {
            values,
            buffers: &buffers,
            stored: None,
        },
    )
}

/// The architecture of a file's state dict and its configuration, every tensor checked, with
/// what else the file holds at hand where the parameters' shapes do not tell enough.
pub(crate) fn infer_file(shapes: &Shapes, beyond: &Beyond) -> Result<ArchConfig, ConfigError> {
    if let Some(arch) = REGISTRY.iter().find(|a| a.detect(shapes)) {
        return arch.infer_with(shapes, beyond);
    }
    if let Some(found) = other_architecture(shapes) {
        return Err(unsupported(found));
    }
    if !shapes.contains_key("conv_first.weight") {
        let sample: Vec<&str> = shapes.keys().take(3).map(String::as_str).collect();
        return Err(unsupported(format!(
            "an unrecognised architecture (keys {})",
            sample.join(", ")
        )));
    }
    FALLBACK.infer(shapes)
}

/// The architectures this build loads, as one line: `DRCT, SwinIR (...) and HAT (...)`.
pub fn supported() -> String {
    let names: Vec<String> = REGISTRY
        .iter()
        .map(|a| match a.loads() {
            "" => a.name().to_string(),
            loads => format!("{} ({loads})", a.name()),
        })
        .collect();
    match names.split_last() {
        Some((last, rest)) if !rest.is_empty() => format!("{} and {last}", rest.join(", ")),
        _ => names.concat(),
    }
}

fn unsupported(found: impl Into<String>) -> ConfigError {
    ConfigError::OtherArchitecture {
        found: found.into(),
        supported: supported(),
    }
}

/// Whether the keys are those of a Swin-family network with residual groups of Swin
/// blocks (SwinIR, HAT, Swin2SR).
pub(crate) fn swin_family(shapes: &Shapes) -> bool {
    shapes
        .keys()
        .any(|k| k.starts_with("layers.") && k.contains(".residual_group.blocks."))
}

/// Whether the keys have SwinV2 blocks (Swin2SR): scaled cosine attention.
pub(crate) fn swin_v2(shapes: &Shapes) -> bool {
    shapes
        .keys()
        .any(|k| k.ends_with(".logit_scale") || k.contains(".cpb_mlp."))
}

/// Whether a state dict's keys are one network's.
type Signature = fn(&Shapes) -> bool;

/// Networks this build does not run, each told by tensor names no registered architecture
/// has (buffers left out: loading drops them), so that such a file is answered with what it
/// is instead of the fallback's first missing tensor. The names come from the reference
/// implementations' state dicts; `src/tests/other_architectures.rs` checks every entry
/// against one of each.
const OTHERS: &[(&str, Signature)] = &[
    ("an ATD checkpoint (adaptive token dictionary)", |s| {
        any(s, |k| k.ends_with(".residual_group.td"))
    }),
    ("a CRAFT checkpoint", |s| {
        any(s, |k| k.contains(".residual_group.srwa_blocks."))
    }),
    ("an RGT checkpoint", |s| {
        has(s, "before_RG.1.weight") && any(s, |k| k.contains(".attn.get_v."))
    }),
    ("a GRL checkpoint", |s| {
        any(s, |k| {
            k.ends_with("attn.window_attn.attn_transform.logit_scale")
        })
    }),
    ("a DITN checkpoint", |s| {
        has(s, "sft.weight") && any(s, |k| k.starts_with("UFONE."))
    }),
    ("a SeemoRe checkpoint", |s| {
        any(s, |k| k.contains(".local_block."))
    }),
    ("a MoESR checkpoint", |s| has(s, "in_to_dim.weight")),
    ("a DCTLSA checkpoint", |s| {
        has(s, "fea_conv.weight") && any(s, |k| k.contains(".transformer_body."))
    }),
    ("a Swift-SRGAN checkpoint", |s| {
        has(s, "initial.cnn.depthwise.weight")
    }),
    ("an IPT checkpoint", |s| has(s, "head.0.0.weight")),
    ("an SCUNet checkpoint (a denoiser)", |s| {
        has(s, "m_head.0.weight") && any(s, |k| k.contains(".trans_block."))
    }),
    ("an FBCNN checkpoint (a JPEG artefact remover)", |s| {
        any(s, |k| k.starts_with("qf_pred."))
    }),
    ("a DRUNet checkpoint (a denoiser)", |s| {
        has(s, "m_head.weight") && any(s, |k| k.starts_with("m_body.") && k.contains(".res."))
    }),
    ("a DnCNN checkpoint (a denoiser)", |s| {
        any(s, |k| {
            k.starts_with("model.") && k.ends_with(".running_mean")
        }) && s
            .keys()
            .all(|k| k.starts_with("model.") && k.matches('.').count() == 2)
    }),
    ("a NAFNet checkpoint (a restoration network)", |s| {
        any(s, |k| k.starts_with("middle_blks."))
    }),
    ("a GFPGAN checkpoint (a face restorer)", |s| {
        any(s, |k| k.starts_with("stylegan_decoder."))
    }),
    ("a RestoreFormer checkpoint (a face restorer)", |s| {
        has(s, "quant_conv.weight") && has(s, "encoder.conv_in.weight")
    }),
    ("a Uformer checkpoint (a restoration network)", |s| {
        has(s, "input_proj.proj.0.weight")
    }),
    ("a LaMa checkpoint (an inpainting network)", |s| {
        any(s, |k| k.starts_with("model.model."))
    }),
    ("an HVI-CIDNet checkpoint (a low-light enhancer)", |s| {
        has(s, "trans.density_k")
    }),
    ("a Retinexformer checkpoint (a low-light enhancer)", |s| {
        any(s, |k| k.contains(".estimator.conv1."))
    }),
];

fn has(shapes: &Shapes, key: &str) -> bool {
    shapes.contains_key(key)
}

fn any(shapes: &Shapes, f: impl Fn(&str) -> bool) -> bool {
    shapes.keys().any(|k| f(k))
}

/// What the keys look like, when they are those of a network in [`OTHERS`].
pub(crate) fn other_architecture(shapes: &Shapes) -> Option<&'static str> {
    OTHERS
        .iter()
        .find(|(_, f)| f(shapes))
        .map(|(name, _)| *name)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shapes(keys: &[&str]) -> Shapes {
        keys.iter().map(|k| (k.to_string(), vec![1])).collect()
    }

    #[test]
    fn the_supported_line_names_every_entry() {
        let line = supported();
        for arch in REGISTRY {
            assert!(line.contains(arch.name()), "{line}");
        }
        assert!(line.contains(" and "), "{line}");
    }

    #[test]
    fn at_most_one_entry_claims_each_kind_of_file() {
        let files = [
            shapes(&["conv_first.weight", "layers.0.swin1.norm1.weight"]),
            shapes(&[
                "conv_first.weight",
                "layers.0.residual_group.blocks.0.norm1.weight",
            ]),
            shapes(&[
                "conv_first.weight",
                "layers.0.residual_group.blocks.0.conv_block.cab.0.weight",
            ]),
            shapes(&[
                "conv_first.weight",
                "layers.0.residual_group.blocks.0.attn.logit_scale",
            ]),
            shapes(&["model.0.weight", "model.1.sub.0.RDB1.conv1.0.weight"]),
            shapes(&["conv_first.weight", "body.0.rdb1.conv1.weight"]),
            shapes(&["conv_first.weight", "RRDB_trunk.0.RDB1.conv1.weight"]),
            shapes(&["body.0.weight", "body.1.weight", "body.2.weight"]),
            shapes(&[
                "conv_1.sk.weight",
                "block_1.c1_r.sk.weight",
                "conv_cat.weight",
            ]),
            shapes(&[
                "conv_first.weight",
                "before_RG.1.weight",
                "layers.0.blocks.0.attn.attns.0.pos.pos_proj.weight",
                "layers.0.blocks.1.attn.temperature",
            ]),
        ];
        let claims: Vec<usize> = files
            .iter()
            .map(|f| REGISTRY.iter().filter(|a| a.detect(f)).count())
            .collect();
        assert_eq!(claims, [1; 10]);
    }

    #[test]
    fn other_architectures_are_named_with_the_registry() {
        let e = infer(&shapes(&[
            "conv_first.weight",
            "layers.0.residual_group.td",
        ]))
        .unwrap_err();
        let text = e.to_string();
        assert!(text.contains("ATD"), "{text}");
        assert!(text.contains(&supported()), "{text}");
    }
}
