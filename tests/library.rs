//! The library's public API as an embedding program uses it: files in, files out, and the
//! errors it can name.

use std::path::Path;

use upscale::{DeviceChoice, ErrorKind, Options, Upscaler};

fn cpu() -> Options {
    Options {
        device: DeviceChoice::Cpu,
        ..Options::default()
    }
}

fn leftovers(dir: &Path) -> Vec<String> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains("upscale-tmp"))
        .collect()
}

#[test]
fn upscale_file_writes_the_output_by_its_extension_and_keeps_16_bits() {
    let dir = tempfile::tempdir().unwrap();
    let up = Upscaler::open(None, &cpu()).unwrap();
    let input = dir.path().join("in.png");
    image::ImageBuffer::<image::Rgb<u16>, _>::from_fn(20, 12, |x, y| {
        image::Rgb([x as u16 * 3000, y as u16 * 5000, 40000])
    })
    .save(&input)
    .unwrap();

    let png = dir.path().join("out.png");
    up.upscale_file(&input, &png).unwrap();
    let out = image::open(&png).unwrap();
    assert_eq!((out.width(), out.height()), (80, 48));
    assert!(
        matches!(out, image::DynamicImage::ImageRgb16(_)),
        "{:?}",
        out.color()
    );

    // JPEG holds 8 bits only: the output follows the format, not the input.
    let jpg = dir.path().join("out.jpg");
    up.upscale_file(&input, &jpg).unwrap();
    let out = image::open(&jpg).unwrap();
    assert_eq!((out.width(), out.height()), (80, 48));
    assert!(matches!(out, image::DynamicImage::ImageRgb8(_)));
    assert!(
        leftovers(dir.path()).is_empty(),
        "{:?}",
        leftovers(dir.path())
    );
}

#[test]
fn upscale_file_names_what_is_wrong_and_writes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let up = Upscaler::open(None, &cpu()).unwrap();
    let missing = dir.path().join("missing.png");
    let err = up
        .upscale_file(&missing, &dir.path().join("out.png"))
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::NotFound, "{err:?}");
    assert_eq!(
        err.to_string(),
        format!("{}: no such file or folder", missing.display())
    );

    let input = dir.path().join("in.png");
    image::RgbImage::from_pixel(8, 8, image::Rgb([9, 99, 199]))
        .save(&input)
        .unwrap();
    let odd = dir.path().join("out.xyz");
    let err = up.upscale_file(&input, &odd).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::Output, "{err:?}");
    assert!(err.to_string().contains("out.xyz"), "{err}");
    assert!(!odd.exists());

    let not_an_image = dir.path().join("notes.png");
    std::fs::write(&not_an_image, b"just text").unwrap();
    let err = up
        .upscale_file(&not_an_image, &dir.path().join("out2.png"))
        .unwrap_err();
    assert_eq!(err.kind(), ErrorKind::BadImage, "{err:?}");
    assert!(err.to_string().contains("notes.png"), "{err}");
    assert!(!dir.path().join("out2.png").exists());
    assert!(leftovers(dir.path()).is_empty());
}

#[test]
fn a_fixed_tile_no_larger_than_the_overlap_is_refused() {
    let opts = Options {
        tile: Some(16),
        overlap: 16,
        ..cpu()
    };
    let err = Upscaler::open(None, &opts).err().expect("refused");
    assert_eq!(err.kind(), ErrorKind::InvalidOption, "{err:?}");
    assert_eq!(
        err.to_string(),
        "tile 16 must be larger than the overlap 16"
    );
}

/// What a program that runs many images does with the pieces (decode, `upscale_image` or
/// `upscale_deferred` and `finish`, encode) gives the file `upscale_file` writes, and the
/// statistics say how the image was tiled.
#[test]
fn the_file_pieces_give_what_upscale_file_writes() {
    let dir = tempfile::tempdir().unwrap();
    let opts = Options {
        tile: Some(16),
        overlap: 4,
        ..cpu()
    };
    let up = Upscaler::open(None, &opts).unwrap();
    let input = dir.path().join("in.png");
    image::RgbaImage::from_fn(30, 20, |x, y| {
        image::Rgba([x as u8 * 8, y as u8 * 12, 77, 255 - x as u8 * 4])
    })
    .save(&input)
    .unwrap();
    let whole = dir.path().join("whole.png");
    up.upscale_file(&input, &whole).unwrap();

    let dec = upscale::io::decode(&input).unwrap();
    let now = up.upscale_image(&dec).unwrap();
    let later = up.upscale_deferred(&dec).unwrap().finish().unwrap();
    assert_eq!((now.rgb.width, now.rgb.height), (120, 80));
    assert!(now.alpha.is_some());
    assert!(now.stats.tiles > 1, "{:?}", now.stats);
    assert_eq!(up.lane_count(), 1);
    assert_eq!(now.lanes.len(), 1);
    assert_eq!((&now.rgb, &now.alpha), (&later.rgb, &later.alpha));

    let pieces = dir.path().join("pieces.png");
    let mut enc = upscale::io::EncodeOptions::new(upscale::Format::Png);
    enc.bit_depth = dec.bit_depth;
    upscale::io::encode(
        &pieces,
        &now.rgb,
        now.alpha.as_ref(),
        dec.gray,
        &dec.metadata,
        &enc,
    )
    .unwrap();
    assert_eq!(
        std::fs::read(&pieces).unwrap(),
        std::fs::read(&whole).unwrap()
    );
}
