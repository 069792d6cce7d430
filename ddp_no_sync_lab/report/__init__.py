"""What a person looks at: the pictures, drawn with Pillow from numbers alone, and the tables verify.py prints and
draws once every check has held.

    pictures      the pictures: confusion matrix, curves, bars, agreement, one window's timeline
    tables        what verify.py prints and draws once every check has held
"""
