//! Round trips through the real codecs, bad inputs, and the PNG speed measurement.
//! Test images are generated here; the few files the image crate cannot write (CMYK JPEG,
//! a PNG declaring absurd dimensions) are assembled by hand.

use std::path::{Path, PathBuf};

use image::codecs::png::PngEncoder;
use image::{DynamicImage, GrayImage, ImageBuffer, ImageEncoder, Luma, LumaA, Rgb, RgbImage, Rgba};

use super::*;
// The steps' own functions, whose typed errors these tests check (the module's public ones
// return the crate's `Error`).
use super::decode::{decode, decode_with_limits};
use super::encode::{encode, write_image};
use crate::planar::Planar;

fn tmp() -> tempfile::TempDir {
    tempfile::tempdir().unwrap()
}

/// Deterministic 32-bit hash noise in [0, 1).
fn noise(x: u32, y: u32, seed: u32) -> f32 {
    let mut h =
        x.wrapping_mul(0x9E37_79B1) ^ y.wrapping_mul(0x85EB_CA77) ^ seed.wrapping_mul(0xC2B2_AE3D);
    h ^= h >> 15;
    h = h.wrapping_mul(0x2C1B_3C6D);
    h ^= h >> 12;
    h = h.wrapping_mul(0x297A_2D39);
    h ^= h >> 15;
    (h >> 8) as f32 / (1u32 << 24) as f32
}

/// Bilinearly interpolated lattice noise with `cell`-pixel cells.
fn value_noise(x: u32, y: u32, cell: u32, seed: u32) -> f32 {
    let (cx, cy) = (x / cell, y / cell);
    let fx = (x % cell) as f32 / cell as f32;
    let fy = (y % cell) as f32 / cell as f32;
    let top = noise(cx, cy, seed) * (1.0 - fx) + noise(cx + 1, cy, seed) * fx;
    let bot = noise(cx, cy + 1, seed) * (1.0 - fx) + noise(cx + 1, cy + 1, seed) * fx;
    top * (1.0 - fy) + bot * fy
}

/// Something with a photo's statistics as far as a compressor cares: smooth shading,
/// texture at several scales, mostly shared between channels, plus a little grain.
fn photo_like(w: u32, h: u32) -> RgbImage {
    RgbImage::from_fn(w, h, |x, y| {
        let shade = 0.5
            + 0.2 * ((x as f32 / 310.0).sin() * (y as f32 / 190.0).cos())
            + 0.25 * (value_noise(x, y, 256, 1) - 0.5)
            + 0.15 * (value_noise(x, y, 32, 2) - 0.5)
            + 0.08 * (value_noise(x, y, 4, 3) - 0.5);
        let mut px = [0u8; 3];
        for (c, v) in px.iter_mut().enumerate() {
            let tint = 0.15 * (value_noise(x, y, 128, 10 + c as u32) - 0.5);
            let grain = (noise(x, y, 20 + c as u32) - 0.5) * 4.0 / 255.0;
            *v = ((shade + tint + grain).clamp(0.0, 1.0) * 255.0).round() as u8;
        }
        Rgb(px)
    })
}

fn gradient_rgb16(w: u32, h: u32) -> ImageBuffer<Rgb<u16>, Vec<u16>> {
    ImageBuffer::from_fn(w, h, |x, y| {
        Rgb([
            (x * 65535 / (w - 1)) as u16,
            (y * 65535 / (h - 1)) as u16,
            ((x * 7919 + y * 104_729) % 65536) as u16,
        ])
    })
}

fn save(img: &DynamicImage, path: &Path) {
    img.save(path).unwrap();
}

/// Expected planes for an 8-bit RGB(A) source, computed independently of decode.
fn planes8(img: &DynamicImage) -> (Vec<f32>, Option<Vec<f32>>) {
    let rgba = img.to_rgba8();
    let n = (rgba.width() * rgba.height()) as usize;
    let mut rgb = vec![0.0; 3 * n];
    let mut alpha = vec![0.0; n];
    for (i, p) in rgba.pixels().enumerate() {
        for c in 0..3 {
            rgb[c * n + i] = p[c] as f32 / 255.0;
        }
        alpha[i] = p[3] as f32 / 255.0;
    }
    (rgb, img.color().has_alpha().then_some(alpha))
}

fn write_back(d: &Decoded, path: &Path, format: Format, depth: u8) -> DynamicImage {
    let mut opts = EncodeOptions::new(format);
    opts.bit_depth = depth;
    encode(path, &d.rgb, d.alpha.as_ref(), d.gray, &d.metadata, &opts).unwrap();
    image::open(path).unwrap()
}

#[test]
fn png_8bit_rgb_round_trip() {
    let dir = tmp();
    let src = DynamicImage::ImageRgb8(photo_like(37, 23));
    let p = dir.path().join("a.png");
    save(&src, &p);
    let d = decode(&p).unwrap();
    assert_eq!((d.rgb.channels, d.rgb.height, d.rgb.width), (3, 23, 37));
    assert_eq!(
        (d.gray, d.bit_depth, d.format, d.alpha.is_none()),
        (false, 8, Format::Png, true)
    );
    assert_eq!(d.rgb.data, planes8(&src).0);
    let back = write_back(&d, &dir.path().join("b.png"), Format::Png, 8);
    assert_eq!(back, src);
}

#[test]
fn png_16bit_round_trip() {
    let dir = tmp();
    let src = DynamicImage::ImageRgb16(gradient_rgb16(40, 30));
    let p = dir.path().join("a.png");
    save(&src, &p);
    let d = decode(&p).unwrap();
    assert_eq!((d.bit_depth, d.gray), (16, false));
    let px = src.as_rgb16().unwrap().get_pixel(39, 0);
    assert_eq!(d.rgb.get(0, 0, 39), px[0] as f32 / 65535.0);
    assert_eq!(
        write_back(&d, &dir.path().join("b.png"), Format::Png, 16),
        src
    );
    // The same data at 8 bits: each sample rounded to the nearest of 255 levels.
    let b8 = write_back(&d, &dir.path().join("c.png"), Format::Png, 8);
    assert_eq!(
        b8,
        DynamicImage::ImageRgb8(ImageBuffer::from_fn(40, 30, |x, y| {
            let p = src.as_rgb16().unwrap().get_pixel(x, y);
            Rgb(p.0.map(|v| (v as f32 / 65535.0 * 255.0).round() as u8))
        }))
    );
}

#[test]
fn gray_png_stays_gray() {
    let dir = tmp();
    let src = DynamicImage::ImageLuma8(GrayImage::from_fn(20, 10, |x, y| {
        Luma([(x * 12 + y) as u8])
    }));
    let p = dir.path().join("g.png");
    save(&src, &p);
    let d = decode(&p).unwrap();
    assert!(d.gray);
    assert_eq!(d.rgb.plane(0), d.rgb.plane(1));
    assert_eq!(d.rgb.plane(0), d.rgb.plane(2));
    assert_eq!(
        write_back(&d, &dir.path().join("h.png"), Format::Png, 8),
        src
    );

    // Gray 16-bit, and a model output that drifted off gray: written as the channel mean.
    let src16 = DynamicImage::ImageLuma16(ImageBuffer::from_fn(8, 8, |x, y| {
        Luma([(x * 8000 + y) as u16])
    }));
    let p16 = dir.path().join("g16.png");
    save(&src16, &p16);
    let mut d16 = decode(&p16).unwrap();
    assert_eq!((d16.gray, d16.bit_depth), (true, 16));
    assert_eq!(
        write_back(&d16, &dir.path().join("h16.png"), Format::Png, 16),
        src16
    );
    let n = 64;
    d16.rgb.data[0] = 0.2;
    d16.rgb.data[n] = 0.3;
    d16.rgb.data[2 * n] = 0.7;
    let out = write_back(&d16, &dir.path().join("m.png"), Format::Png, 8);
    assert_eq!(
        out.as_luma8().unwrap().get_pixel(0, 0)[0],
        (0.4f32 * 255.0).round() as u8
    );
}

#[test]
fn rgba_png_keeps_alpha() {
    let dir = tmp();
    let src = DynamicImage::ImageRgba8(ImageBuffer::from_fn(16, 9, |x, y| {
        Rgba([x as u8 * 16, y as u8 * 28, 200, (x * 16 + y) as u8])
    }));
    let p = dir.path().join("a.png");
    save(&src, &p);
    let d = decode(&p).unwrap();
    let (rgb, alpha) = planes8(&src);
    assert_eq!(d.rgb.data, rgb);
    assert_eq!(d.alpha.as_ref().unwrap().data, alpha.unwrap());
    assert_eq!(
        write_back(&d, &dir.path().join("b.png"), Format::Png, 8),
        src
    );
    // Gray + alpha, to PNG (LA) and to TIFF (no LA layout there: RGBA with equal channels).
    let la = DynamicImage::ImageLumaA8(ImageBuffer::from_fn(6, 5, |x, y| {
        LumaA([(x * 40) as u8, (y * 60) as u8])
    }));
    let pla = dir.path().join("la.png");
    save(&la, &pla);
    let dla = decode(&pla).unwrap();
    assert!(dla.gray && dla.alpha.is_some());
    assert_eq!(
        write_back(&dla, &dir.path().join("la2.png"), Format::Png, 8),
        la
    );
    let t = write_back(&dla, &dir.path().join("la.tif"), Format::Tiff, 8);
    assert_eq!(t.to_luma_alpha8(), la.to_luma_alpha8());
    assert!(t.color().has_alpha());
    // JPEG cannot hold alpha: it is dropped.
    let j = write_back(&d, &dir.path().join("a.jpg"), Format::Jpeg, 8);
    assert!(!j.color().has_alpha());
}

fn mean_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| (x - y).abs()).sum::<f32>() / a.len() as f32
}

#[test]
fn jpeg_rgb_and_gray() {
    let dir = tmp();
    let src = DynamicImage::ImageRgb8(photo_like(64, 48));
    let p = dir.path().join("a.jpg");
    save(&src, &p);
    let d = decode(&p).unwrap();
    assert_eq!((d.format, d.gray, d.bit_depth), (Format::Jpeg, false, 8));
    assert!(mean_abs_diff(&d.rgb.data, &planes8(&src).0) < 0.03);
    let back = write_back(&d, &dir.path().join("b.jpg"), Format::Jpeg, 8);
    assert_eq!(back.color(), image::ColorType::Rgb8);

    let gsrc = DynamicImage::ImageLuma8(src.to_luma8());
    let gp = dir.path().join("g.jpg");
    save(&gsrc, &gp);
    let g = decode(&gp).unwrap();
    assert!(g.gray);
    assert!(mean_abs_diff(&g.rgb.data, &planes8(&gsrc).0) < 0.03);
    let gback = write_back(&g, &dir.path().join("h.jpg"), Format::Jpeg, 8);
    assert_eq!(gback.color(), image::ColorType::L8);
}

#[test]
fn jpeg_quality_is_used() {
    let dir = tmp();
    let src = DynamicImage::ImageRgb8(photo_like(128, 128));
    let p = dir.path().join("a.png");
    save(&src, &p);
    let d = decode(&p).unwrap();
    let size = |q: u8| {
        let out = dir.path().join(format!("q{q}.jpg"));
        let mut opts = EncodeOptions::new(Format::Jpeg);
        opts.quality = q;
        encode(&out, &d.rgb, None, false, &Metadata::default(), &opts).unwrap();
        std::fs::metadata(out).unwrap().len()
    };
    assert!(size(40) < size(95));
}

#[test]
fn webp_is_lossless() {
    let dir = tmp();
    for src in [
        DynamicImage::ImageRgb8(photo_like(33, 17)),
        DynamicImage::ImageRgba8(ImageBuffer::from_fn(9, 7, |x, y| {
            Rgba([x as u8, y as u8, 9, (x * y) as u8])
        })),
    ] {
        let p = dir.path().join("a.webp");
        save(&src, &p);
        let d = decode(&p).unwrap();
        assert_eq!(d.format, Format::Webp);
        assert_eq!(d.alpha.is_some(), src.color().has_alpha());
        assert_eq!(
            write_back(&d, &dir.path().join("b.webp"), Format::Webp, 8),
            src
        );
    }
}

#[test]
fn tiff_16bit_round_trip() {
    let dir = tmp();
    let src = DynamicImage::ImageRgb16(gradient_rgb16(21, 13));
    let p = dir.path().join("a.tiff");
    save(&src, &p);
    let d = decode(&p).unwrap();
    assert_eq!((d.format, d.bit_depth), (Format::Tiff, 16));
    assert_eq!(
        write_back(&d, &dir.path().join("b.tif"), Format::Tiff, 16),
        src
    );
}

#[test]
fn sixteen_bits_for_jpeg_or_webp_is_an_error() {
    let dir = tmp();
    let rgb = Planar::zeros(3, 4, 4);
    for format in [Format::Jpeg, Format::Webp] {
        let out = dir.path().join(format!("x.{}", format.extension()));
        let mut opts = EncodeOptions::new(format);
        opts.bit_depth = 16;
        let e = encode(&out, &rgb, None, false, &Metadata::default(), &opts).unwrap_err();
        assert!(matches!(e, IoError::Encode { .. }), "{e}");
        assert!(e.to_string().contains("8-bit only"), "{e}");
        assert!(!out.exists());
    }
}

#[test]
fn out_of_range_samples_are_clamped_and_rounded() {
    let dir = tmp();
    let rgb = Planar::new(
        3,
        1,
        4,
        vec![
            -0.5,
            1.5,
            f32::NAN,
            0.5, //
            0.0,
            1.0,
            0.498,
            0.502, //
            0.3,
            0.3,
            0.3,
            0.3,
        ],
    );
    let out = dir.path().join("c.png");
    encode(
        &out,
        &rgb,
        None,
        false,
        &Metadata::default(),
        &EncodeOptions::new(Format::Png),
    )
    .unwrap();
    let img = image::open(&out).unwrap().to_rgb8();
    let r: Vec<u8> = img.pixels().map(|p| p[0]).collect();
    let g: Vec<u8> = img.pixels().map(|p| p[1]).collect();
    assert_eq!(r, [0, 255, 0, 128]); // 127.5 rounds away from zero
    assert_eq!(g, [0, 255, 127, 128]);
}

/// A TIFF-structured EXIF block holding only the orientation tag, as PNG's eXIf chunk and
/// JPEG's APP1 (after "Exif\0\0") carry it.
fn exif_orientation(value: u16) -> Vec<u8> {
    let mut e = b"MM\0\x2a\0\0\0\x08".to_vec(); // big-endian TIFF header, IFD at offset 8
    e.extend(1u16.to_be_bytes()); // one entry
    e.extend(0x0112u16.to_be_bytes()); // Orientation
    e.extend(3u16.to_be_bytes()); // SHORT
    e.extend(1u32.to_be_bytes()); // count
    e.extend(value.to_be_bytes());
    e.extend([0, 0]); // value field padding
    e.extend(0u32.to_be_bytes()); // no next IFD
    e
}

#[test]
fn exif_orientation_is_applied() {
    let dir = tmp();
    // 3 wide, 2 high, every pixel distinct.
    let src = RgbImage::from_fn(3, 2, |x, y| Rgb([(10 + x * 10 + y * 100) as u8, 0, 0]));
    let p = dir.path().join("o.png");
    let mut bytes = Vec::new();
    let mut enc = PngEncoder::new(&mut bytes);
    // 6 = "rotate 90° clockwise to display".
    enc.set_exif_metadata(exif_orientation(6)).unwrap();
    enc.write_image(src.as_raw(), 3, 2, image::ExtendedColorType::Rgb8)
        .unwrap();
    std::fs::write(&p, &bytes).unwrap();

    let d = decode(&p).unwrap();
    assert_eq!((d.rgb.width, d.rgb.height), (2, 3));
    let red = |x, y| (d.rgb.get(0, y, x) * 255.0).round() as u32;
    // Rotated clockwise: the bottom-left source pixel is now top-left.
    assert_eq!([red(0, 0), red(1, 0)], [110, 10]);
    assert_eq!([red(0, 2), red(1, 2)], [130, 30]);

    // The same through JPEG's APP1, with 3 = "rotate 180°"; flat halves survive the lossy codec.
    let halves = RgbImage::from_fn(32, 16, |x, _| {
        if x < 16 {
            Rgb([250, 0, 0])
        } else {
            Rgb([0, 0, 250])
        }
    });
    let mut jbytes = Vec::new();
    let mut jenc = image::codecs::jpeg::JpegEncoder::new_with_quality(&mut jbytes, 95);
    jenc.set_exif_metadata(exif_orientation(3)).unwrap();
    jenc.write_image(halves.as_raw(), 32, 16, image::ExtendedColorType::Rgb8)
        .unwrap();
    let jp = dir.path().join("o.jpg");
    std::fs::write(&jp, &jbytes).unwrap();
    let j = decode(&jp).unwrap();
    assert_eq!((j.rgb.width, j.rgb.height), (32, 16));
    assert!(
        j.rgb.get(2, 8, 4) > 0.9 && j.rgb.get(0, 8, 4) < 0.1,
        "left is blue now"
    );
    assert!(
        j.rgb.get(0, 8, 28) > 0.9 && j.rgb.get(2, 8, 28) < 0.1,
        "right is red now"
    );
}

fn segment(out: &mut Vec<u8>, marker: u8, body: &[u8]) {
    out.extend([0xFF, marker]);
    out.extend(((body.len() + 2) as u16).to_be_bytes());
    out.extend(body);
}

/// A minimal baseline CMYK JPEG (the image crate has no CMYK encoder): one row of 8×8
/// blocks, each a flat colour, so only DC coefficients are coded (quantizer 1, standard DC
/// Huffman table, an AC table holding just end-of-block). `blocks[i]` are the stored C, M,
/// Y, K samples of block i; an Adobe APP14 marker with transform 0 says "CMYK, as stored".
/// Like Photoshop's files, stored samples are inverted (255 = no ink), which is how
/// decoders read Adobe CMYK.
fn cmyk_jpeg(blocks: &[[u8; 4]]) -> Vec<u8> {
    let (w, h) = (8 * blocks.len() as u16, 8u16);
    let mut out = vec![0xFF, 0xD8];
    segment(&mut out, 0xEE, b"Adobe\x00\x64\x00\x00\x00\x00\x00");
    let mut dqt = vec![0u8];
    dqt.extend([1u8; 64]);
    segment(&mut out, 0xDB, &dqt);
    let mut sof = vec![8];
    sof.extend(h.to_be_bytes());
    sof.extend(w.to_be_bytes());
    sof.push(4);
    for id in 1..=4 {
        sof.extend([id, 0x11, 0]);
    }
    segment(&mut out, 0xC0, &sof);
    const DC_BITS: [u8; 16] = [0, 1, 5, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0];
    let mut dht = vec![0x00];
    dht.extend(DC_BITS);
    dht.extend(0..=11u8);
    dht.push(0x10);
    dht.extend([1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
    dht.push(0x00); // EOB, code "0"
    segment(&mut out, 0xC4, &dht);
    let mut sos = vec![4];
    for id in 1..=4 {
        sos.extend([id, 0x00]);
    }
    sos.extend([0, 63, 0]);
    segment(&mut out, 0xDA, &sos);

    // Canonical Huffman codes for DC categories 0..=11.
    let mut codes = Vec::new();
    let mut code = 0u32;
    for (len, &count) in DC_BITS.iter().enumerate() {
        for _ in 0..count {
            codes.push((code, len as u32 + 1));
            code += 1;
        }
        code <<= 1;
    }
    let mut bits: Vec<bool> = Vec::new();
    let mut put = |value: u32, len: u32| {
        for i in (0..len).rev() {
            bits.push(value >> i & 1 == 1);
        }
    };
    let mut pred = [0i32; 4];
    for block in blocks {
        for c in 0..4 {
            // A flat block of value v has DC = 8 (v - 128) in JPEG's DCT scaling.
            let dc = 8 * (block[c] as i32 - 128);
            let diff = dc - pred[c];
            pred[c] = dc;
            let cat = 32 - diff.unsigned_abs().leading_zeros();
            let (code, len) = codes[cat as usize];
            put(code, len);
            let extra = if diff >= 0 {
                diff
            } else {
                diff + (1 << cat) - 1
            };
            put(extra as u32, cat);
            put(0, 1); // end of block
        }
    }
    while !bits.len().is_multiple_of(8) {
        bits.push(true);
    }
    for byte in bits.chunks(8) {
        let b = byte.iter().fold(0u8, |acc, &bit| acc << 1 | bit as u8);
        out.push(b);
        if b == 0xFF {
            out.push(0); // byte stuffing
        }
    }
    out.extend([0xFF, 0xD9]);
    out
}

#[test]
fn cmyk_jpeg_decodes_to_rgb() {
    let dir = tmp();
    let p = dir.path().join("cmyk.jpg");
    std::fs::write(
        &p,
        cmyk_jpeg(&[[255, 0, 255, 255], [128, 255, 0, 200], [255, 255, 255, 0]]),
    )
    .unwrap();
    let d = decode(&p).unwrap();
    assert_eq!(
        (d.rgb.width, d.rgb.height, d.gray, d.format),
        (24, 8, false, Format::Jpeg)
    );
    let px = |x| [0, 1, 2].map(|c| (d.rgb.get(c, 4, x) * 255.0).round() as i32);
    // R = C·K/255, G = M·K/255, B = Y·K/255 on the stored (inverted) samples.
    let close = |a: [i32; 3], b: [i32; 3]| a.iter().zip(b).all(|(x, y)| (x - y).abs() <= 2);
    assert!(close(px(3), [255, 0, 255]), "{:?}", px(3));
    assert!(close(px(11), [100, 200, 0]), "{:?}", px(11));
    assert!(close(px(19), [0, 0, 0]), "{:?}", px(19));
}

// ---- bad inputs ----

fn assert_names(e: &IoError, p: &Path) {
    let msg = e.to_string();
    assert!(msg.starts_with(&p.display().to_string()), "{msg}");
    assert!(!msg.contains('\n'), "{msg}");
    assert_eq!(e.path(), p);
}

fn crc32(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in data {
        crc ^= b as u32;
        for _ in 0..8 {
            crc = if crc & 1 == 1 {
                crc >> 1 ^ 0xEDB8_8320
            } else {
                crc >> 1
            };
        }
    }
    !crc
}

/// A valid small PNG whose IHDR is rewritten (CRC fixed) to declare `w`×`h`.
fn png_declaring(w: u32, h: u32) -> Vec<u8> {
    let mut bytes = Vec::new();
    DynamicImage::ImageRgb8(RgbImage::new(4, 4))
        .write_to(
            &mut std::io::Cursor::new(&mut bytes),
            image::ImageFormat::Png,
        )
        .unwrap();
    // Signature (8), length (4), "IHDR" (4), then width and height.
    bytes[16..20].copy_from_slice(&w.to_be_bytes());
    bytes[20..24].copy_from_slice(&h.to_be_bytes());
    let crc = crc32(&bytes[12..29]);
    bytes[29..33].copy_from_slice(&crc.to_be_bytes());
    bytes
}

#[test]
fn bad_inputs_give_the_right_error() {
    let dir = tmp();
    let at = |name: &str| -> PathBuf { dir.path().join(name) };

    let missing = at("missing.png");
    let e = decode(&missing).unwrap_err();
    assert!(matches!(e, IoError::NotFound { .. }), "{e}");
    assert_names(&e, &missing);

    let empty = at("empty.png");
    std::fs::write(&empty, b"").unwrap();
    let e = decode(&empty).unwrap_err();
    assert!(matches!(e, IoError::Empty { .. }), "{e}");
    assert_names(&e, &empty);

    let text = at("notes.png");
    std::fs::write(&text, b"just some text, not a picture\n").unwrap();
    let e = decode(&text).unwrap_err();
    assert!(matches!(e, IoError::NotAnImage { .. }), "{e}");
    assert_names(&e, &text);

    let gif = at("anim.png");
    std::fs::write(&gif, b"GIF89a\x01\x00\x01\x00\x00\x00\x00;").unwrap();
    let e = decode(&gif).unwrap_err();
    assert!(matches!(e, IoError::UnsupportedFormat { .. }), "{e}");
    assert!(e.to_string().contains("GIF"), "{e}");

    let mut full = Vec::new();
    DynamicImage::ImageRgb8(photo_like(64, 64))
        .write_to(
            &mut std::io::Cursor::new(&mut full),
            image::ImageFormat::Png,
        )
        .unwrap();
    let cut = at("cut.png");
    std::fs::write(&cut, &full[..full.len() / 2]).unwrap();
    let e = decode(&cut).unwrap_err();
    assert!(matches!(e, IoError::Truncated { .. }), "{e}");
    assert_names(&e, &cut);

    let bomb = at("bomb.png");
    std::fs::write(&bomb, png_declaring(100_000, 100_000)).unwrap();
    let e = decode(&bomb).unwrap_err();
    assert!(matches!(e, IoError::TooLarge { .. }), "{e}");
    assert!(e.to_string().contains("100000x100000"), "{e}");
    assert_names(&e, &bomb);

    // Within the side limit but not the memory limit: 16000² RGB8 is 732 MiB.
    let wide = at("wide.png");
    std::fs::write(&wide, png_declaring(16_000, 16_000)).unwrap();
    let small = DecodeLimits {
        max_alloc: 256 << 20,
        ..DecodeLimits::default()
    };
    let e = decode_with_limits(&wide, &small).unwrap_err();
    assert!(matches!(e, IoError::TooLarge { .. }), "{e}");

    let folder = at("folder.png");
    std::fs::create_dir(&folder).unwrap();
    let e = decode(&folder).unwrap_err();
    assert_names(&e, &folder);
}

#[test]
fn truncated_files_of_every_format_fail_cleanly() {
    let dir = tmp();
    let src = DynamicImage::ImageRgb8(photo_like(64, 64));
    for ext in ["png", "jpg", "webp", "tif"] {
        let p = dir.path().join(format!("a.{ext}"));
        save(&src, &p);
        let bytes = std::fs::read(&p).unwrap();
        for keep in [bytes.len() / 2, 20, 9] {
            std::fs::write(&p, &bytes[..keep]).unwrap();
            // JPEG decoders fill missing data in rather than fail; what matters is no panic,
            // and an error that names the file when there is one.
            if let Err(e) = decode(&p) {
                assert_names(&e, &p);
            }
        }
    }
}

#[test]
fn failing_encode_leaves_nothing_behind() {
    let dir = tmp();
    let out = dir.path().join("wide.jpg");
    // JPEG sides stop at 65535: the encoder fails after the temporary was opened.
    let rgb = Planar::zeros(1, 1, 65_536);
    let e = encode(
        &out,
        &rgb,
        None,
        true,
        &Metadata::default(),
        &EncodeOptions::new(Format::Jpeg),
    )
    .unwrap_err();
    assert!(matches!(e, IoError::Encode { .. }), "{e}");
    assert_names(&e, &out);
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
}

/// Encode time and size of a photo-like 2048² RGB image per PNG setting; the numbers
/// behind DEFAULT_PNG_COMPRESSION. Run with `--ignored --nocapture`.
#[test]
#[ignore]
fn png_speed() {
    use image::codecs::png::{CompressionType as C, FilterType as F};
    let img = DynamicImage::ImageRgb8(photo_like(2048, 2048));
    let raw = 2048 * 2048 * 3;
    println!("| compression | filter | ms | MB | % of raw |");
    for c in [
        C::Fast,
        C::Level(1),
        C::Level(3),
        C::Default,
        C::Level(6),
        C::Best,
    ] {
        for f in [F::NoFilter, F::Sub, F::Up, F::Paeth, F::Adaptive] {
            let mut opts = EncodeOptions::new(Format::Png);
            (opts.png_compression, opts.png_filter) = (c, f);
            let mut best = f64::MAX;
            let mut size = 0;
            for _ in 0..2 {
                let mut buf = std::io::Cursor::new(Vec::new());
                let t = std::time::Instant::now();
                write_image(&mut buf, &img, &Metadata::default(), &opts).unwrap();
                best = best.min(t.elapsed().as_secs_f64());
                size = buf.get_ref().len();
            }
            println!(
                "| {c:?} | {f:?} | {:.0} | {:.2} | {:.1} |",
                best * 1e3,
                size as f64 / 1e6,
                100.0 * size as f64 / raw as f64
            );
        }
    }
}

/// An ICC profile of 128 header bytes naming `space`: enough for the writers and our check.
fn header_only_icc(space: &[u8; 4]) -> Vec<u8> {
    let mut p = vec![0u8; 128];
    p[16..20].copy_from_slice(space);
    p
}

/// `rgb` written in bands of `band` rows through [`encode_bands`].
fn write_in_bands(
    path: &Path,
    rgb: &Planar,
    layout: BandLayout,
    meta: &Metadata,
    opts: &EncodeOptions,
    band: usize,
) -> Vec<String> {
    encode_bands(path, layout, meta, opts, |sink| {
        let (h, w) = (rgb.height, rgb.width);
        let mut top = 0;
        while top < h {
            let n = band.min(h - top);
            let mut data = Vec::with_capacity(3 * n * w);
            for c in 0..3 {
                data.extend_from_slice(&rgb.plane(c)[top * w..(top + n) * w]);
            }
            sink(Planar::new(3, n, w, data))?;
            top += n;
        }
        Ok::<(), IoError>(())
    })
    .unwrap()
}

#[test]
fn bands_write_the_samples_and_metadata_of_the_whole_image() {
    let dir = tmp();
    // Odd sizes, samples outside [0, 1] and NaN, so clamping and rounding are exercised.
    let (w, h) = (37, 23);
    let data: Vec<f32> = (0..3 * w * h)
        .map(|i| match i % 97 {
            0 => f32::NAN,
            1 => 1.5,
            2 => -0.25,
            _ => noise(i as u32, 7, 3),
        })
        .collect();
    let rgb = Planar::new(3, h, w, data);
    let gray_rgb = {
        let p = rgb.plane(0).to_vec();
        Planar::new(3, h, w, [p.clone(), p.clone(), p].concat())
    };
    let meta = |space: &[u8; 4]| Metadata {
        icc: Some(header_only_icc(space)),
        exif: None,
        exif_dropped: false,
    };
    for format in [Format::Png, Format::Tiff] {
        for depth in [8, 16] {
            for (gray, alpha) in [
                (false, None),
                (true, None),
                (false, Some(0.6f32)),
                (true, Some(1.0)),
            ] {
                let src = if gray { &gray_rgb } else { &rgb };
                let meta = meta(if gray && !(alpha.is_some() && format == Format::Tiff) {
                    b"GRAY"
                } else {
                    b"RGB "
                });
                let mut opts = EncodeOptions::new(format);
                opts.bit_depth = depth;
                let case = format!("{format} {depth}-bit gray {gray} alpha {alpha:?}");
                let whole = dir.path().join(format!("whole.{}", format.extension()));
                let alpha_plane = alpha.map(|a| Planar::new(1, h, w, vec![a; w * h]));
                let kept = encode(&whole, src, alpha_plane.as_ref(), gray, &meta, &opts).unwrap();
                let banded = dir.path().join(format!("bands.{}", format.extension()));
                let layout = BandLayout {
                    width: w,
                    height: h,
                    gray,
                    alpha,
                };
                let left = write_in_bands(&banded, src, layout, &meta, &opts, 5);
                assert_eq!(left, kept, "{case}");
                let (a, b) = (
                    std::fs::read(&whole).unwrap(),
                    std::fs::read(&banded).unwrap(),
                );
                if format == Format::Tiff {
                    assert!(a == b, "{case}: files differ");
                }
                let (da, db) = (decode(&whole).unwrap(), decode(&banded).unwrap());
                assert_eq!(da.rgb, db.rgb, "{case}");
                assert_eq!(da.alpha, db.alpha, "{case}");
                assert_eq!((da.gray, da.bit_depth), (db.gray, db.bit_depth), "{case}");
                assert_eq!(da.metadata.icc, db.metadata.icc, "{case}");
                assert!(db.metadata.icc.is_some(), "{case}: no ICC profile");
            }
        }
    }
}

#[test]
fn a_failing_producer_leaves_nothing_behind() {
    let dir = tmp();
    let out = dir.path().join("out.png");
    let layout = BandLayout {
        width: 8,
        height: 8,
        gray: false,
        alpha: None,
    };
    let opts = EncodeOptions::new(Format::Png);
    let r = encode_bands(&out, layout, &Metadata::default(), &opts, |sink| {
        sink(Planar::zeros(3, 4, 8))?;
        Err(IoError::bad_output(&out, "the network failed"))
    });
    assert!(r.unwrap_err().to_string().contains("the network failed"));
    // Too few rows is an error too, not a short file.
    let r = encode_bands(&out, layout, &Metadata::default(), &opts, |sink| {
        sink(Planar::zeros(3, 4, 8))
    });
    assert!(r.unwrap_err().to_string().contains("4 of 8 rows"));
    let left: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
    assert!(left.is_empty(), "{left:?}");
    // JPEG cannot be written in bands.
    let r = encode_bands(
        &dir.path().join("out.jpg"),
        layout,
        &Metadata::default(),
        &EncodeOptions::new(Format::Jpeg),
        |_| Ok::<(), IoError>(()),
    );
    assert!(r.is_err());
}
