print("convert placeholder")
