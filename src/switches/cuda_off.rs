//! `UPSCALE_CUDA_OFF`: which of our own CUDA paths a run leaves out, each falling back to
//! candle's ops for the same result (slower; they are what the GPU tests hold ours to). On a
//! GPU where one of ours fails, a user can still run, and a short GPU session can still
//! measure everything else. Window attention has its own switch, `--attention reference`.
//! `sass` keeps our kernels but loads them from PTX, for a GPU whose driver refuses the
//! built SASS, and to measure what the SASS saves at start.

use crate::switches::EnvError;

/// The environment variable: a comma-separated list of the parts below, `all` or `none`.
pub const VAR: &str = "UPSCALE_CUDA_OFF";

/// The parts of the CUDA path that can be left out.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Off {
    /// cuBLASLt GEMMs with the bias in their epilogue ([`crate::ops::linear::cuda`]).
    pub cublaslt: bool,
    /// The row-wise kernels of kernels/rowwise.cu ([`crate::ops::rowwise`]).
    pub rowwise: bool,
    /// HAT's channel-attention term (`z * s`, scaled per image and channel) folded into the
    /// residual sum and norm after window attention
    /// ([`crate::ops::norm::cuda::add_gather_norm`]): off, candle multiplies and adds it in
    /// passes of their own, as before that kernel.
    pub cab: bool,
    /// The SASS built for the target GPU: our kernels load from their PTX, which the driver
    /// compiles on first use, as on a GPU newer than the build's ([`crate::gpu`]).
    pub sass: bool,
}

const PARTS: &str = "cublaslt, rowwise, cab, sass, all or none";

impl Off {
    pub const ALL: Off = Off {
        cublaslt: true,
        rowwise: true,
        cab: true,
        sass: true,
    };

    pub fn parse(spec: &str) -> Result<Off, EnvError> {
        let mut off = Off::default();
        for part in spec.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            match part.to_ascii_lowercase().as_str() {
                "cublaslt" => off.cublaslt = true,
                "rowwise" => off.rowwise = true,
                "cab" => off.cab = true,
                "sass" => off.sass = true,
                "all" => off = Off::ALL,
                "none" => {}
                _ => {
                    return Err(EnvError::UnknownPart {
                        var: VAR,
                        part: part.to_string(),
                        expected: PARTS,
                    })
                }
            }
        }
        Ok(off)
    }

    /// What a run with these parts off does differently, for the line it prints.
    pub fn effect(self) -> String {
        let mut said = Vec::new();
        if self.cublaslt || self.rowwise || self.cab {
            said.push("candle's ops run in place of ours there");
        }
        if self.sass {
            said.push("our kernels load from PTX, which the driver compiles");
        }
        said.join("; ")
    }

    /// The parts left out, as the variable names them ("" for none).
    pub fn names(self) -> String {
        let parts = [
            ("cublaslt", self.cublaslt),
            ("rowwise", self.rowwise),
            ("cab", self.cab),
            ("sass", self.sass),
        ];
        let on: Vec<&str> = parts.iter().filter(|p| p.1).map(|p| p.0).collect();
        on.join(",")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_parts_lists_and_names_them_back() {
        assert_eq!(Off::parse(""), Ok(Off::default()));
        assert_eq!(Off::parse("none"), Ok(Off::default()));
        let lt = Off::parse("cuBLASLt").unwrap();
        assert!(lt.cublaslt && !lt.rowwise && !lt.sass);
        let row = Off::parse(" rowwise ,").unwrap();
        assert!(row.rowwise && !row.cublaslt && !row.sass);
        let sass = Off::parse("SASS").unwrap();
        assert!(sass.sass && !sass.rowwise && !sass.cublaslt);
        let cab = Off::parse("CAB").unwrap();
        assert!(cab.cab && !cab.rowwise && !cab.cublaslt && !cab.sass);
        assert!(cab.effect().contains("candle") && !cab.effect().contains("PTX"));
        assert_eq!(cab.names(), "cab");
        assert_eq!(Off::parse("sass,cab,rowwise,cublaslt"), Ok(Off::ALL));
        assert_ne!(Off::parse("sass,rowwise,cublaslt"), Ok(Off::ALL));
        assert_eq!(Off::parse("all"), Ok(Off::ALL));
        assert_eq!(Off::ALL.names(), "cublaslt,rowwise,cab,sass");
        assert_eq!(row.names(), "rowwise");
        assert_eq!(Off::default().names(), "");
        assert!(!sass.effect().contains("candle") && sass.effect().contains("PTX"));
        assert!(row.effect().contains("candle") && !row.effect().contains("PTX"));
    }

    #[test]
    fn an_unknown_part_is_refused_by_name() {
        let e = Off::parse("rowwise,attention").unwrap_err();
        let e = e.to_string();
        assert!(e.contains(VAR) && e.contains("'attention'"), "{e}");
    }
}
