//! The colour profile and EXIF of an input, carried to its output.
//!
//! Decoding turns the pixels upright, so the EXIF kept has its orientation tag set to 1:
//! otherwise viewers would rotate the already rotated output a second time.

/// What of an input file's metadata its output should carry.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Metadata {
    /// The embedded ICC colour profile, as stored.
    pub icc: Option<Vec<u8>>,
    /// EXIF as a TIFF-structured block without the `Exif\0\0` prefix (the encoders add
    /// what their container needs), its orientation set to 1 to match the upright planes.
    pub exif: Option<Vec<u8>>,
    /// The input had EXIF that could not be rewritten with certainty, so none is written:
    /// a stale orientation would turn the output on its side in every viewer.
    pub exif_dropped: bool,
}

impl Metadata {
    /// Takes a decoder's raw EXIF; see [`upright_exif`].
    pub(crate) fn with_exif(icc: Option<Vec<u8>>, exif: Option<Vec<u8>>) -> Self {
        let icc = icc.filter(|p| !p.is_empty());
        match exif.filter(|e| !e.is_empty()) {
            None => Metadata {
                icc,
                exif: None,
                exif_dropped: false,
            },
            Some(raw) => {
                let exif = upright_exif(&raw);
                Metadata {
                    icc,
                    exif_dropped: exif.is_none(),
                    exif,
                }
            }
        }
    }
}

const EXIF_PREFIX: &[u8] = b"Exif\0\0";
const TAG_ORIENTATION: u16 = 0x0112;
const TYPE_SHORT: u16 = 3;
const TIFF_HEADER_LEN: usize = 8;
const IFD_ENTRY_LEN: usize = 12;

/// `exif` (a TIFF-structured block, with or without the `Exif\0\0` prefix JPEG uses) with
/// the orientation in its first directory set to 1 ("as stored"), and the prefix removed.
/// A block without an orientation tag comes back unchanged. `None` when the block is not
/// laid out as expected (bad byte-order mark, directory outside the block, an orientation
/// that is not one SHORT, two of them), since writing it could keep a rotation the pixels
/// no longer need.
pub fn upright_exif(exif: &[u8]) -> Option<Vec<u8>> {
    let mut tiff = exif.strip_prefix(EXIF_PREFIX).unwrap_or(exif).to_vec();
    let big_endian = match tiff.get(..4)? {
        [b'I', b'I', 42, 0] => false,
        [b'M', b'M', 0, 42] => true,
        _ => return None,
    };
    let read16 = |b: &[u8], at: usize| -> Option<u16> {
        let bytes: [u8; 2] = b.get(at..at.checked_add(2)?)?.try_into().ok()?;
        Some(match big_endian {
            true => u16::from_be_bytes(bytes),
            false => u16::from_le_bytes(bytes),
        })
    };
    let read32 = |b: &[u8], at: usize| -> Option<u32> {
        let bytes: [u8; 4] = b.get(at..at.checked_add(4)?)?.try_into().ok()?;
        Some(match big_endian {
            true => u32::from_be_bytes(bytes),
            false => u32::from_le_bytes(bytes),
        })
    };

    let ifd0 = usize::try_from(read32(&tiff, 4)?).ok()?;
    if ifd0 < TIFF_HEADER_LEN {
        return None;
    }
    let entries = usize::from(read16(&tiff, ifd0)?);
    let first = ifd0.checked_add(2)?;
    let end = first.checked_add(entries.checked_mul(IFD_ENTRY_LEN)?)?;
    if end > tiff.len() {
        return None;
    }
    let one = match big_endian {
        true => 1u16.to_be_bytes(),
        false => 1u16.to_le_bytes(),
    };
    let mut seen = false;
    for entry in (first..end).step_by(IFD_ENTRY_LEN) {
        if read16(&tiff, entry)? != TAG_ORIENTATION {
            continue;
        }
        if seen || read16(&tiff, entry + 2)? != TYPE_SHORT || read32(&tiff, entry + 4)? != 1 {
            return None;
        }
        seen = true;
        // One SHORT sits left-aligned in the 4-byte value field, whatever the byte order.
        tiff.get_mut(entry + 8..entry + 10)?.copy_from_slice(&one);
    }
    Some(tiff)
}

/// Whether an ICC profile describes the colour space of the pixels written: a CMYK JPEG's
/// profile, say, would make viewers misread the RGB output. The space is the 4-byte
/// signature at offset 16 of the 128-byte header.
pub(crate) fn icc_fits(icc: &[u8], rgb: bool) -> bool {
    if icc.len() < 128 {
        return false;
    }
    match &icc[16..20] {
        b"RGB " => rgb,
        b"GRAY" => !rgb,
        _ => false,
    }
}

/// The colour space an ICC profile names, for messages.
pub(crate) fn icc_space(icc: &[u8]) -> String {
    match icc.get(16..20) {
        Some(sig) if sig.iter().all(|b| b.is_ascii_graphic() || *b == b' ') => {
            String::from_utf8_lossy(sig).trim_end().to_string()
        }
        _ => "an unknown space".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A TIFF header and one directory holding `entries` (tag, type, count, value), each
    /// value written left-aligned as a SHORT.
    fn tiff(big: bool, entries: &[(u16, u16, u32, u16)]) -> Vec<u8> {
        let w16 = |v: u16| {
            if big {
                v.to_be_bytes()
            } else {
                v.to_le_bytes()
            }
        };
        let w32 = |v: u32| {
            if big {
                v.to_be_bytes()
            } else {
                v.to_le_bytes()
            }
        };
        let mut b = if big {
            b"MM\0\x2a".to_vec()
        } else {
            b"II\x2a\0".to_vec()
        };
        b.extend(w32(8));
        b.extend(w16(entries.len() as u16));
        for &(tag, kind, count, value) in entries {
            b.extend(w16(tag));
            b.extend(w16(kind));
            b.extend(w32(count));
            b.extend(w16(value));
            b.extend([0, 0]);
        }
        b.extend(w32(0));
        b
    }

    fn orientation_of(exif: &[u8]) -> Option<u8> {
        image::metadata::Orientation::from_exif_chunk(exif).map(|o| o.to_exif())
    }

    const MAKE: (u16, u16, u32, u16) = (0x010f, 2, 2, 0x4100);
    const SOFTWARE: (u16, u16, u32, u16) = (0x0131, 2, 2, 0x4200);

    #[test]
    fn orientation_is_reset_in_both_byte_orders() {
        for big in [false, true] {
            let raw = tiff(big, &[MAKE, (TAG_ORIENTATION, TYPE_SHORT, 1, 6), SOFTWARE]);
            assert_eq!(orientation_of(&raw), Some(6));
            let out = upright_exif(&raw).unwrap();
            assert_eq!(orientation_of(&out), Some(1), "big endian {big}");
            // Only the two value bytes change.
            let changed: Vec<usize> = (0..raw.len()).filter(|&i| raw[i] != out[i]).collect();
            assert_eq!(changed.len(), 1, "{changed:?}");
            assert_eq!(out.len(), raw.len());
        }
    }

    #[test]
    fn jpeg_prefix_is_removed() {
        let raw = tiff(true, &[(TAG_ORIENTATION, TYPE_SHORT, 1, 8)]);
        let mut prefixed = EXIF_PREFIX.to_vec();
        prefixed.extend(&raw);
        let out = upright_exif(&prefixed).unwrap();
        assert!(out.starts_with(b"MM"));
        assert_eq!(out.len(), raw.len());
        assert_eq!(orientation_of(&out), Some(1));
    }

    #[test]
    fn without_an_orientation_the_block_is_unchanged() {
        let raw = tiff(false, &[MAKE, SOFTWARE]);
        assert_eq!(upright_exif(&raw).unwrap(), raw);
        let empty_dir = tiff(true, &[]);
        assert_eq!(upright_exif(&empty_dir).unwrap(), empty_dir);
    }

    #[test]
    fn unexpected_layouts_are_left_out() {
        // An orientation that is not one SHORT, or two of them.
        assert_eq!(
            upright_exif(&tiff(false, &[(TAG_ORIENTATION, 4, 1, 6)])),
            None
        );
        assert_eq!(
            upright_exif(&tiff(false, &[(TAG_ORIENTATION, TYPE_SHORT, 2, 6)])),
            None
        );
        let twice = (TAG_ORIENTATION, TYPE_SHORT, 1, 6);
        assert_eq!(upright_exif(&tiff(true, &[twice, twice])), None);

        // Directory pointing into the header, or past the end.
        let mut raw = tiff(false, &[(TAG_ORIENTATION, TYPE_SHORT, 1, 6)]);
        raw[4..8].copy_from_slice(&2u32.to_le_bytes());
        assert_eq!(upright_exif(&raw), None);
        raw[4..8].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(upright_exif(&raw), None);

        // A count of entries larger than the block.
        let mut raw = tiff(true, &[MAKE]);
        raw[8..10].copy_from_slice(&0xffffu16.to_be_bytes());
        assert_eq!(upright_exif(&raw), None);

        // Bad byte-order marks.
        assert_eq!(upright_exif(b"IM\x2a\0\x08\0\0\0\0\0"), None);
        assert_eq!(upright_exif(b"II\0\x2a\x08\0\0\0\0\0"), None);
    }

    #[test]
    fn every_truncation_and_garbage_is_handled() {
        let raw = tiff(
            false,
            &[MAKE, (TAG_ORIENTATION, TYPE_SHORT, 1, 3), SOFTWARE],
        );
        // Cut anywhere inside the directory the block is refused; past it (the next-directory
        // pointer) it is still sound.
        let dir_end = TIFF_HEADER_LEN + 2 + 3 * IFD_ENTRY_LEN;
        for len in 0..raw.len() {
            let got = upright_exif(&raw[..len]);
            assert_eq!(got.is_some(), len >= dir_end, "cut at {len}");
        }
        let mut prefixed = EXIF_PREFIX.to_vec();
        prefixed.extend(&raw);
        for len in 0..prefixed.len() {
            let _ = upright_exif(&prefixed[..len]);
        }

        // Pseudo-random bytes behind both marks: no panic, whatever comes back.
        let mut state = 0x2545_f491_4f6c_dd1du64;
        for round in 0..2000 {
            let mut b = if round % 2 == 0 {
                b"II\x2a\0".to_vec()
            } else {
                b"MM\0\x2a".to_vec()
            };
            for _ in 0..(round % 64) {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                b.push(state as u8 % 24);
            }
            let _ = upright_exif(&b);
        }
    }

    #[test]
    fn metadata_marks_exif_it_could_not_rewrite() {
        let m = Metadata::with_exif(Some(vec![1, 2]), Some(b"not exif".to_vec()));
        assert_eq!(
            (m.icc, m.exif, m.exif_dropped),
            (Some(vec![1, 2]), None, true)
        );
        let m = Metadata::with_exif(Some(Vec::new()), Some(Vec::new()));
        assert_eq!(m, Metadata::default());
    }

    #[test]
    fn icc_must_match_the_pixels() {
        let mut icc = vec![0u8; 200];
        icc[16..20].copy_from_slice(b"RGB ");
        assert!(icc_fits(&icc, true) && !icc_fits(&icc, false));
        icc[16..20].copy_from_slice(b"GRAY");
        assert!(icc_fits(&icc, false) && !icc_fits(&icc, true));
        icc[16..20].copy_from_slice(b"CMYK");
        assert!(!icc_fits(&icc, true) && !icc_fits(&icc, false));
        assert_eq!(icc_space(&icc), "CMYK");
        assert!(!icc_fits(&icc[..100], true));
        assert_eq!(icc_space(&[0xff; 30]), "an unknown space");
    }
}
